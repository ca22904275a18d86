"""Cost projection: what the hero run costs in time, money and disk on each machine of the hardware table.

The model is deliberately simple and every input is on the page:
- tokens per stage: generate = samples x output tokens; extract = samples x tokens; train = that x epochs.
- throughput on a row = measured throughput on the reference row x (GPUs the row uses / GPUs the measurement used)
  x speed factor. The speed factor is a measured pair when given (`speed_factors`), else a ratio of peak figures:
  bandwidth for generation (decoding reads the weights for every token: memory-bound), BF16 FLOP/s for extraction and
  training (prefill and training: compute-bound). Its range spans both ratios, widened by `factor_uncertainty`,
  because real speed-ups differ from peak ratios (kernels, interconnect, software).
- time = tokens / throughput; cost = time x the row's $/hour (range: fast end x low price .. slow end x high price).
- disk: generated text (samples x tokens x text bytes/token) and hidden states (extracted tokens x bytes/token).
- MFU of a measured run = FLOPs/token x tokens/s / (peak BF16 FLOP/s x GPUs): 2 x active verifier parameters for
  generation and extraction (a forward pass), 6 x drafter parameters x TTT steps for training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from eagle3lib.analysis.hardware import HardwareRow, get_row, load_hardware, resolve_path
from eagle3lib.config.analysis import CostProjectionConfig
from eagle3lib.core.manifest import read_manifest

STAGE_ORDER = ("generate", "extract", "train")
BOUND = {"generate": "bandwidth", "extract": "compute", "train": "compute"}  # what limits each stage
HOUR = 3600.0


# ------------------------------------------------------------------------------------------------- measurements
@dataclass
class Measurement:
    stage: str
    tokens_per_s: float
    gpus: int
    source: str  # "manifest PATH" or "entered by hand"
    bytes_per_token: float | None = None  # extract only


# stage -> (config field, manifest figure) for the throughput
THROUGHPUT = {
    "generate": ("generate_output_tokens_per_s", "output_tokens_per_s"),
    "extract": ("extract_tokens_per_s", "tokens_per_s"),
    "train": ("train_tokens_per_s", "tokens_per_s"),
}


class _Manifests:
    """Reads a run's manifests on demand; every error names the manifest file and the figure."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._cache: dict[str, dict] = {}

    def path(self, stage: str) -> Path:
        return self.run_dir / stage / "manifest.json"

    def figures(self, stage: str, cfg_field: str) -> dict[str, Any]:
        if stage not in self._cache:
            m = read_manifest(self.run_dir / stage)
            if m is None:
                raise ValueError(f"{self.path(stage)}: no manifest (run the {stage} stage first, or enter its "
                                 f"throughput by hand: --set cost_projection.{cfg_field}=...)")
            self._cache[stage] = m.get("figures") or {}
        return self._cache[stage]

    def number(self, stage: str, key: str, cfg_field: str, default: float | None = None) -> float:
        figs = self.figures(stage, cfg_field)
        v = figs.get(key, default)
        if v is None:
            raise ValueError(f"{self.path(stage)}: figures has no '{key}' (enter it by hand: "
                             f"--set cost_projection.{cfg_field}=...)")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{self.path(stage)}: figures.{key} = {v!r} is not a positive number "
                             f"(enter it by hand: --set cost_projection.{cfg_field}=...)")
        return float(v)


def measurements(cfg: CostProjectionConfig, run_dir: Path, reference: HardwareRow) -> dict[str, Measurement]:
    """The reference throughputs of the configured stages: from the profile where entered, else from the manifests."""
    man = _Manifests(run_dir)
    out = {}
    for stage in [s for s in STAGE_ORDER if s in cfg.stages]:
        fld, key = THROUGHPUT[stage]
        by_hand = getattr(cfg, fld)
        note = f"entered by hand{': ' + cfg.measurement_note if cfg.measurement_note else ''}"
        tps = float(by_hand) if by_hand is not None else man.number(stage, key, fld)
        src = note if by_hand is not None else f"manifest {man.path(stage)}"
        if stage == "generate":
            gpus = cfg.generate_gpus or reference.count
            out[stage] = Measurement(stage, tps, gpus, src)
        elif stage == "extract":
            bpt = cfg.extract_bytes_per_token
            online = by_hand is None and man.figures(stage, fld).get("hidden_states", "offline") != "offline"
            if online:  # the extract stage stored tokens only: the trainer's verifier measured the states' throughput
                tps = man.number("train", "states_computed_tokens", fld) / man.number("train", "states_verifier_s", fld)
                src = f"manifest {man.path('train')} (states computed online)"
            if bpt is None and online:
                bpt = man.number(stage, "offline_bytes", "extract_bytes_per_token") / man.number(
                    stage, "tokens", "extract_bytes_per_token")
            elif bpt is None:
                figs = man.figures(stage, "extract_bytes_per_token")
                if figs.get("bytes_per_token") is None and figs.get("bytes") and figs.get("tokens"):
                    bpt = float(figs["bytes"]) / float(figs["tokens"])
                else:
                    bpt = man.number(stage, "bytes_per_token", "extract_bytes_per_token")
            gpus = cfg.extract_gpus or (int(man.number(stage, "num_gpus", "extract_gpus", default=1))
                                        if by_hand is None else reference.count)
            out[stage] = Measurement(stage, tps, gpus, src, bpt)
        else:
            gpus = cfg.train_gpus or (int(man.number(stage, "num_processes", "train_gpus", default=1))
                                      if by_hand is None else reference.count)
            out[stage] = Measurement(stage, tps, gpus, src)
    if not out:
        raise ValueError("cost_projection.stages is empty: nothing to project")
    return out


# ------------------------------------------------------------------------------------------------- the hero run
@dataclass(frozen=True)
class HeroSpec:
    samples: int
    avg_tokens: float
    avg_output_tokens: float
    epochs: float
    text_bytes_per_token: float

    @classmethod
    def from_cfg(cls, cfg: CostProjectionConfig) -> HeroSpec:
        out = cfg.avg_output_tokens_per_sample if cfg.avg_output_tokens_per_sample is not None else cfg.avg_tokens_per_sample
        return cls(cfg.samples, cfg.avg_tokens_per_sample, out, cfg.epochs, cfg.text_bytes_per_token)

    def scaled(self, factor: float) -> HeroSpec:
        """The same run with every sample `factor` times as long (the sequence-length sensitivity)."""
        return HeroSpec(self.samples, self.avg_tokens * factor, self.avg_output_tokens * factor, self.epochs,
                        self.text_bytes_per_token)

    def tokens(self, stage: str) -> float:
        if stage == "generate":
            return self.samples * self.avg_output_tokens
        if stage == "extract":
            return self.samples * self.avg_tokens
        return self.samples * self.avg_tokens * self.epochs

    def disk_bytes(self, stage: str, m: Measurement) -> float:
        if stage == "generate":
            return self.samples * self.avg_tokens * self.text_bytes_per_token  # prompts and responses, as JSONL
        if stage == "extract":
            return self.samples * self.avg_tokens * (m.bytes_per_token or 0.0)
        return 0.0  # a drafter checkpoint is small next to the hidden states


def stage_hours(tokens: float, tokens_per_s: float) -> float:
    """Hours to process `tokens` at `tokens_per_s` (the hand check: 10,000 x 4,000 tokens at 2,912/s = 3.8 h)."""
    if tokens_per_s <= 0:
        raise ValueError(f"throughput must be > 0, got {tokens_per_s}")
    return tokens / tokens_per_s / HOUR


# ------------------------------------------------------------------------------------------------- speed model
@dataclass(frozen=True)
class SpeedFactor:
    point: float
    lo: float
    hi: float
    basis: str
    flops_ratio: float
    bw_ratio: float


def speed_factor(row: HardwareRow, ref: HardwareRow, stage: str, measured: dict[str, float] | None = None,
                 uncertainty: float = 0.25) -> SpeedFactor:
    """Per-GPU speed of `row` relative to `ref` for one stage, with its range and where it comes from."""
    fr, br = row.bf16_tflops / ref.bf16_tflops, row.mem_bw_tbs / ref.mem_bw_tbs
    if row.name == ref.name:
        return SpeedFactor(1.0, 1.0, 1.0, "reference hardware: measured here", fr, br)
    if measured and row.name in measured:
        f = float(measured[row.name])
        return SpeedFactor(f, f, f, f"measured pair: {f:.3g}x the reference (cost_projection.speed_factors)", fr, br)
    point = br if BOUND[stage] == "bandwidth" else fr
    lo, hi = min(fr, br) * (1 - uncertainty), max(fr, br) * (1 + uncertainty)
    which = "bandwidth" if BOUND[stage] == "bandwidth" else "FLOP/s"
    basis = (f"peak ratios: BF16 FLOP/s {fr:.2f}x, memory bandwidth {br:.2f}x; point = {which} ratio "
             f"({stage} is {BOUND[stage]}-bound); range = both ratios -/+{uncertainty:.0%}")
    return SpeedFactor(point, lo, hi, basis, fr, br)


def gpu_scale(row: HardwareRow, m: Measurement, scale_with_gpu_count: bool) -> float:
    """GPUs the row uses / GPUs the measurement used (data-parallel scaling assumed)."""
    used = row.count if scale_with_gpu_count else min(m.gpus, row.count)
    return used / m.gpus


# ------------------------------------------------------------------------------------------------- projection
@dataclass
class CostProjection:
    spec: HeroSpec
    reference: HardwareRow
    rows: list[HardwareRow]
    measured: dict[str, Measurement]
    factors: dict[tuple[str, str], SpeedFactor]  # (row, stage)
    scale_with_gpu_count: bool
    flops_per_token: dict[str, float | None]
    hardware_file: Path
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The hero run in one line, then the notes (markdown)."""
        s = self.spec
        head = (f"Hero run: {s.samples:,} samples x {s.avg_tokens:,.0f} tokens ({s.avg_output_tokens:,.0f} generated), "
                f"{s.epochs:g} epoch(s).")
        return "\n".join([head, *(f"- note: {n}" for n in self.notes)])

    # ---- per (row, stage)
    def rate(self, row: HardwareRow, stage: str, factor: float | None = None) -> float:
        m = self.measured[stage]
        f = self.factors[(row.name, stage)].point if factor is None else factor
        return m.tokens_per_s * gpu_scale(row, m, self.scale_with_gpu_count) * f

    def table(self, spec: HeroSpec | None = None) -> pl.DataFrame:
        """A row per (hardware, stage) plus a `total` per hardware: hours, cost and disk with their ranges."""
        spec = spec or self.spec
        recs = []
        for row in self.rows:
            tot = dict.fromkeys(("hours", "hours_lo", "hours_hi", "usd", "usd_lo", "usd_hi", "disk_gb"), 0.0)
            for stage in self.measured:
                sf = self.factors[(row.name, stage)]
                tokens = spec.tokens(stage)
                h = stage_hours(tokens, self.rate(row, stage))
                h_lo = stage_hours(tokens, self.rate(row, stage, sf.hi))
                h_hi = stage_hours(tokens, self.rate(row, stage, sf.lo))
                r = {"hardware": row.name, "stage": stage, "tokens": tokens,
                     "tokens_per_s": self.rate(row, stage), "speed_factor": sf.point, "factor_lo": sf.lo,
                     "factor_hi": sf.hi, "gpu_scale": gpu_scale(row, self.measured[stage], self.scale_with_gpu_count),
                     "hours": h, "hours_lo": h_lo, "hours_hi": h_hi, "usd": h * row.usd_per_hour,
                     "usd_lo": h_lo * row.price_lo, "usd_hi": h_hi * row.price_hi,
                     "disk_gb": spec.disk_bytes(stage, self.measured[stage]) / 1e9, "basis": sf.basis}
                recs.append(r)
                for k in tot:
                    tot[k] += r[k]
            recs.append({"hardware": row.name, "stage": "total", "tokens": None, "tokens_per_s": None,
                         "speed_factor": None, "factor_lo": None, "factor_hi": None, "gpu_scale": None, **tot,
                         "basis": ""})
        return pl.DataFrame(recs, infer_schema_length=None)

    def totals(self, spec: HeroSpec | None = None) -> pl.DataFrame:
        t = self.table(spec).filter(pl.col("stage") == "total").drop("stage", "tokens", "tokens_per_s", "speed_factor",
                                                                      "factor_lo", "factor_hi", "gpu_scale", "basis")
        info = pl.DataFrame({"hardware": [r.name for r in self.rows], "gpu": [r.gpu for r in self.rows],
                             "count": [r.count for r in self.rows], "usd_per_hour": [r.usd_per_hour for r in self.rows],
                             "owned": [r.owned for r in self.rows]})
        return info.join(t, on="hardware", how="left", maintain_order="left")

    def inputs(self) -> pl.DataFrame:
        """The measured throughputs and where each came from."""
        return pl.DataFrame({
            "stage": list(self.measured),
            "tokens_per_s": [m.tokens_per_s for m in self.measured.values()],
            "gpus": [m.gpus for m in self.measured.values()],
            "bytes_per_token": [m.bytes_per_token for m in self.measured.values()],
            "on": [self.reference.name] * len(self.measured),
            "source": [m.source for m in self.measured.values()],
        })

    def hardware_table(self) -> pl.DataFrame:
        rows = self.rows if self.reference in self.rows else [self.reference, *self.rows]
        recs = []
        for r in rows:
            d = r.model_dump()
            rng = d.pop("usd_per_hour_range")
            recs.append({"name": d.pop("name"), **d, "usd_per_hour_range": f"{rng[0]:g}-{rng[1]:g}" if rng else "",
                         "reference": r.name == self.reference.name})
        return pl.DataFrame(recs, infer_schema_length=None)

    def mfu(self) -> pl.DataFrame:
        """MFU the measured runs reached on the reference hardware: FLOPs/token x tokens/s / (peak x GPUs)."""
        recs = []
        for stage, m in self.measured.items():
            fpt = self.flops_per_token.get(stage)
            peak = self.reference.bf16_tflops * 1e12 * m.gpus
            achieved = fpt * m.tokens_per_s if fpt else None
            recs.append({"stage": stage, "hardware": self.reference.name, "gpus": m.gpus,
                         "tokens_per_s": m.tokens_per_s, "flops_per_token": fpt,
                         "achieved_tflops": achieved / 1e12 if achieved else None, "peak_tflops": peak / 1e12,
                         "mfu": achieved / peak if achieved else None})
        return pl.DataFrame(recs, infer_schema_length=None)

    def breakeven(self) -> pl.DataFrame:
        """Owned vs rented: hours saved by renting, what each saved wall-clock hour costs, and the wall-clock hours of
        owned-hardware work after which buying the owned machine beats renting (purchase / rented $ per owned hour)."""
        tot = {r["hardware"]: r for r in self.totals().iter_rows(named=True)}
        recs = []
        for o in [r for r in self.rows if r.owned]:
            for rent in [r for r in self.rows if not r.owned and r.usd_per_hour > 0]:
                to, tr, cr = tot[o.name]["hours"], tot[rent.name]["hours"], tot[rent.name]["usd"]
                saved = to - tr
                per_owned_hour = cr / to if to > 0 else None
                be_hours = o.purchase_usd / per_owned_hour if o.purchase_usd and per_owned_hour else None
                recs.append({"owned": o.name, "rented": rent.name, "owned_hours": to, "rented_hours": tr,
                             "rented_usd": cr, "hours_saved_by_renting": saved,
                             "usd_per_hour_saved": cr / saved if saved > 0 else None,
                             "rented_usd_per_owned_hour": per_owned_hour,
                             "breakeven_owned_hours": be_hours,
                             "breakeven_runs": be_hours / to if be_hours and to > 0 else None})
        return pl.DataFrame(recs, infer_schema_length=None)

    # ---- sensitivity
    def sensitivity_seq_len(self, lo: float = 0.25, hi: float = 4.0, n: int = 25) -> pl.DataFrame:
        """Total hours and cost per row as the average sequence length runs from `lo` to `hi` x the spec's
        (throughput per token held at the measured value: attention's growth with length is not modelled)."""
        frames = []
        for f in np.geomspace(lo, hi, n):
            spec = self.spec.scaled(float(f))
            t = self.totals(spec).select("hardware", "hours", "usd")
            frames.append(t.with_columns(pl.lit(spec.avg_tokens).alias("avg_tokens_per_sample")))
        return pl.concat(frames)

    def sensitivity_speed(self, n: int = 40) -> pl.DataFrame:
        """Total hours and cost of each non-reference row as one speed factor (applied to every stage) sweeps from half
        its lowest estimate to 1.5x its highest; `estimate` marks the projected point."""
        recs = []
        for row in self.rows:
            if row.name == self.reference.name:
                continue
            sfs = [self.factors[(row.name, s)] for s in self.measured]
            base = sum(stage_hours(self.spec.tokens(s), self.rate(row, s, 1.0)) for s in self.measured)  # at factor 1
            proj = sum(stage_hours(self.spec.tokens(s), self.rate(row, s)) for s in self.measured)
            eff = base / proj
            lo, hi = min(sf.lo for sf in sfs), max(sf.hi for sf in sfs)
            for f in np.geomspace(lo / 2, hi * 1.5, n):
                recs.append({"hardware": row.name, "speed_factor": float(f), "hours": base / f,
                             "usd": base / f * row.usd_per_hour, "estimate": eff, "range_lo": lo, "range_hi": hi})
        return pl.DataFrame(recs, infer_schema_length=None)

    # ---- the manifest's flat figures
    def figures(self) -> dict[str, float]:
        out: dict[str, float] = {"samples": self.spec.samples, "avg_tokens_per_sample": self.spec.avg_tokens,
                                 "epochs": self.spec.epochs}
        for stage, m in self.measured.items():
            out[f"{stage}_tokens"] = self.spec.tokens(stage)
            out[f"{stage}_measured_tokens_per_s"] = m.tokens_per_s
            out[f"{stage}_disk_gb"] = self.spec.disk_bytes(stage, m) / 1e9
        out["total_disk_gb"] = sum(self.spec.disk_bytes(s, m) for s, m in self.measured.items()) / 1e9
        for r in self.table().iter_rows(named=True):
            key = f"{r['hardware']}.{r['stage']}"
            out[f"{key}_hours"] = r["hours"]
            out[f"{key}_hours_lo"], out[f"{key}_hours_hi"] = r["hours_lo"], r["hours_hi"]
            out[f"{key}_usd"] = r["usd"]
            out[f"{key}_usd_lo"], out[f"{key}_usd_hi"] = r["usd_lo"], r["usd_hi"]
            if r["stage"] != "total":
                out[f"{key}_speed_factor"] = r["speed_factor"]
        for r in self.mfu().iter_rows(named=True):
            if r["mfu"] is not None:
                out[f"mfu_{r['stage']}"] = r["mfu"]
        for r in self.breakeven().iter_rows(named=True):
            if r["breakeven_owned_hours"] is not None:
                out[f"breakeven.{r['owned']}.vs.{r['rented']}_owned_hours"] = r["breakeven_owned_hours"]
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def project(cfg: CostProjectionConfig, run_dir: Path, train_ttt_steps: int | None = None) -> CostProjection:
    """Everything from the config: hardware rows, measurements (profile or manifests), speed factors, FLOPs/token."""
    hw_path = resolve_path(cfg.hardware_file)
    table = load_hardware(hw_path)
    ref = get_row(table, cfg.reference_hardware, hw_path, "cost_projection.reference_hardware")
    for name in cfg.speed_factors:
        get_row(table, name, hw_path, "cost_projection.speed_factors")
    rows = [get_row(table, n, hw_path, "cost_projection.hardware") for n in cfg.hardware] if cfg.hardware else \
        list(table.values())
    measured = measurements(cfg, run_dir, ref)
    factors = {(r.name, s): speed_factor(r, ref, s, cfg.speed_factors, cfg.factor_uncertainty)
               for r in rows for s in measured}
    notes = []
    ttt = cfg.ttt_steps or train_ttt_steps
    fpt: dict[str, float | None] = {"generate": None, "extract": None, "train": None}
    if cfg.verifier_active_params:
        fpt["generate"] = fpt["extract"] = 2 * cfg.verifier_active_params
    else:
        notes.append("no verifier_active_params: no MFU for generation and extraction")
    if cfg.drafter_params and ttt:
        fpt["train"] = 6 * cfg.drafter_params * ttt
    elif "train" in measured:
        notes.append("no drafter_params (or TTT steps): no training MFU")
    return CostProjection(HeroSpec.from_cfg(cfg), ref, rows, measured, factors, cfg.scale_with_gpu_count, fpt, hw_path,
                          notes)
