"""Learning curves: one frame per run from its metrics (eagle3lib/analysis/log_sources.py reads them), de-duplicated,
completed, smoothed, with an ETA, and the latest values of each run.

Records that several ranks wrote alike are de-duplicated on (kind, step), keeping rank 0 when ranks are labelled and
the last copy otherwise, which is also right for a run resumed from a checkpoint that re-logs a few steps.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from eagle3lib.analysis.log_sources import (
    TEXT_COLUMNS,
    Source,
    detect_format,
    expand_sources,
    fetch,
    parse_jsonl,
    parse_speculators_log,
    parse_tensorboard,
)
from eagle3lib.config.analysis import LearningCurvesConfig
from eagle3lib.core.atomic import write_bytes_atomic
from eagle3lib.core.manifest import read_manifest

INT_COLUMNS = ("step", "total_steps", "tokens_seen", "samples_seen")
TTT_PREFIXES = ("loss", "full_acc", "cond_acc")
SMOOTHED = ("loss", "tau_est", "tokens_per_s", "samples_per_s", "grad_norm")  # plus every per-TTT-step column
DEFAULT_METRICS = Path("train") / "metrics.jsonl"
_TTT_RE = re.compile(r"^(loss|full_acc|cond_acc)_(\d+)$")


# --------------------------------------------------------------------------------------------------------- frames
def rows_to_frame(rows: list[dict[str, Any]], label: str) -> pl.DataFrame:
    cols: dict[str, None] = {"run": None, "kind": None, "step": None}
    for r in rows:
        cols.update(dict.fromkeys(r))
    data = {}
    for c in cols:
        values = [label] * len(rows) if c == "run" else [r.get(c) for r in rows]
        if c in TEXT_COLUMNS:
            dtype = pl.Utf8
        elif c in INT_COLUMNS:
            values = [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else int(v) for v in values]
            dtype = pl.Int64
        else:
            dtype = pl.Float64
        data[c] = pl.Series(c, values, dtype=dtype, strict=False)
    return pl.DataFrame(data)


def dedupe(frame: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """One record per (kind, step): rank 0's when records carry a rank, else the last copy (a resume re-logs steps)."""
    n = frame.height
    if "rank" in frame.columns and frame["rank"].drop_nulls().len():
        frame = frame.filter(pl.col("rank").is_null() | (pl.col("rank") == pl.col("rank").min()))
    frame = frame.unique(subset=["kind", "step"], keep="last", maintain_order=True).sort(["step", "kind"])
    return frame, n - frame.height


def ttt_steps(frame: pl.DataFrame) -> int:
    ks = [int(m.group(2)) for c in frame.columns if (m := _TTT_RE.match(c))]
    return max(ks) + 1 if ks else 0


def _complete(frame: pl.DataFrame) -> pl.DataFrame:
    """Derived columns: tau_est where missing, elapsed_s from time, tokens_seen of val records from the train rows."""
    K = ttt_steps(frame)
    full = [f"full_acc_{k}" for k in range(K) if f"full_acc_{k}" in frame.columns]
    if full:
        derived = 1 + pl.sum_horizontal([pl.col(c) for c in full])
        if "tau_est" in frame.columns:
            frame = frame.with_columns(pl.col("tau_est").fill_null(derived))
        else:
            frame = frame.with_columns(derived.alias("tau_est"))
    if "time" in frame.columns:
        # elapsed_s counts from the run's start, which may precede the first record: align on rows that have both
        offset = (frame["time"] - frame["elapsed_s"]).drop_nulls() if "elapsed_s" in frame.columns else None
        base = offset.median() if offset is not None and offset.len() else frame["time"].min()
        from_time = pl.col("time") - base
        if "elapsed_s" in frame.columns:
            frame = frame.with_columns(pl.col("elapsed_s").fill_null(from_time))
        else:
            frame = frame.with_columns(from_time.alias("elapsed_s"))
    if "tokens_seen" in frame.columns and frame.filter(pl.col("kind") == "val").height:
        train = frame.filter((pl.col("kind") == "train") & pl.col("tokens_seen").is_not_null()).select(
            "step", pl.col("tokens_seen").alias("_tok")).sort("step")
        if train.height:
            frame = frame.sort("step").join_asof(train, on="step", strategy="backward").with_columns(
                pl.col("tokens_seen").fill_null(pl.col("_tok"))).drop("_tok").sort(["step", "kind"])
    return frame


def smoothed_columns(frame: pl.DataFrame) -> list[str]:
    return [c for c in frame.columns if c in SMOOTHED or _TTT_RE.match(c)]


def add_smoothing(frame: pl.DataFrame, smoothing: float) -> pl.DataFrame:
    """`<col>_smooth`: bias-corrected EMA over the train records (TensorBoard's smoothing); val rows keep raw values."""
    cols = smoothed_columns(frame)
    train = pl.col("kind") == "train"

    def ema(c: str) -> pl.Expr:
        raw = pl.col(c)
        return raw if smoothing <= 0 else raw.ewm_mean(alpha=1 - smoothing, adjust=True, ignore_nulls=True)

    # val records are interleaved with train ones: smooth the train subset alone, then put both back in order
    tr = frame.filter(train).with_columns(ema(c).alias(f"{c}_smooth") for c in cols)
    va = frame.filter(~train).with_columns(pl.col(c).alias(f"{c}_smooth") for c in cols)
    return pl.concat([tr, va], how="diagonal_relaxed").sort(["step", "kind"])


def add_eta(frame: pl.DataFrame, total_steps: int | None, window: int) -> pl.DataFrame:
    """`steps_per_s` over the last `window` train records and `eta_s` = steps left / that rate, per train record."""
    train = frame.filter(pl.col("kind") == "train")
    if "elapsed_s" not in frame.columns or train["elapsed_s"].drop_nulls().len() < 2:
        return frame
    total = pl.lit(total_steps) if total_steps else (pl.col("total_steps") if "total_steps" in frame.columns else None)
    first = pl.col("step").first(), pl.col("elapsed_s").first()
    d_step = pl.col("step") - pl.col("step").shift(window - 1).fill_null(first[0])
    d_time = pl.col("elapsed_s") - pl.col("elapsed_s").shift(window - 1).fill_null(first[1])
    train = train.with_columns(pl.when(d_time > 0).then(d_step / d_time).otherwise(None).alias("steps_per_s"))
    if total is not None:
        train = train.with_columns(
            ((total - pl.col("step")).clip(lower_bound=0) / pl.col("steps_per_s")).alias("eta_s"))
    return pl.concat([train, frame.filter(pl.col("kind") != "train")], how="diagonal_relaxed").sort(["step", "kind"])


# --------------------------------------------------------------------------------------------------------- runs
@dataclass
class RunMetrics:
    source: Source
    format: str
    frame: pl.DataFrame
    lines: int
    records: int
    torn_last_line: bool
    bad_lines: int
    duplicates_dropped: int
    total_steps: int | None
    local_copy: str | None = None

    @property
    def label(self) -> str:
        return self.source.label


def load_run(source: Source, fmt: str = "auto", smoothing: float = 0.9, eta_window: int = 50,
             total_steps: int | None = None, timeout_s: float = 60.0, copy_dir: Path | None = None) -> RunMetrics:
    """Fetch, parse, de-duplicate and complete one metrics file; every error names the file."""
    where = source.location
    if source.tensorboard:
        return _finish_run(source, "tensorboard", parse_tensorboard(source), smoothing, eta_window, total_steps, None)
    data = fetch(source, timeout_s)
    local_copy = None
    if source.ssh is not None and copy_dir is not None:  # what the report was made from, kept next to it
        safe = re.sub(r"[^\w.\-]+", "_", source.label).strip("_") or "remote"
        local_copy = str(copy_dir / f"{safe}{Path(source.ssh.path).suffix or '.log'}")
        write_bytes_atomic(local_copy, data)
    if not data.strip():
        raise ValueError(f"{where}: the metrics file is empty (training has not logged its first record yet?)")
    kind = detect_format(data) if fmt == "auto" else fmt
    if kind is None:
        raise ValueError(f"{where}: no metrics lines (expected JSON lines with a 'step', or speculators console lines "
                         "like 'train/loss_0=2.31, ..., global_step=12')")
    parsed = parse_jsonl(data, where) if kind == "eagle3lib" else parse_speculators_log(data, where)
    return _finish_run(source, kind, parsed, smoothing, eta_window, total_steps, local_copy)


def _finish_run(source: Source, kind: str, parsed, smoothing: float, eta_window: int, total_steps: int | None,
                local_copy: str | None) -> RunMetrics:
    where = source.location
    if not parsed.rows:
        raise ValueError(f"{where}: no metrics records among {parsed.lines} lines (format {kind}; "
                         f"{parsed.bad_lines} unreadable)")
    frame = rows_to_frame(parsed.rows, source.label)
    frame, dropped = dedupe(frame)
    frame = _complete(frame)
    total = total_steps or parsed.total_steps
    if total is None and "total_steps" in frame.columns and frame["total_steps"].drop_nulls().len():
        total = int(frame["total_steps"].drop_nulls()[-1])
    frame = add_smoothing(frame, smoothing)
    frame = add_eta(frame, total, eta_window)
    return RunMetrics(source, kind, frame, parsed.lines, len(parsed.rows), parsed.torn_last_line, parsed.bad_lines,
                      dropped, total, local_copy)


def combined(runs: list[RunMetrics]) -> pl.DataFrame:
    return pl.concat([r.frame for r in runs], how="diagonal_relaxed")


def _last(frame: pl.DataFrame, col: str) -> float | None:
    if col not in frame.columns:
        return None
    s = frame[col].drop_nulls()
    if not s.len():
        return None
    v = s[-1]
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def latest(run: RunMetrics) -> dict[str, Any]:
    """The latest values of one run, numbers only (None where the log has none)."""
    f = run.frame
    train, val = f.filter(pl.col("kind") == "train"), f.filter(pl.col("kind") == "val")
    K = ttt_steps(f)
    out: dict[str, Any] = {"step": _last(train, "step"), "total_steps": run.total_steps}
    if out["step"] is not None and run.total_steps:
        out["progress_pct"] = 100.0 * out["step"] / run.total_steps
    for c in ("epoch", "tokens_seen", "samples_seen", "loss", "loss_smooth"):
        out[c] = _last(train, c)
    for prefix in TTT_PREFIXES:
        for k in range(K):
            out[f"{prefix}_{k}"] = _last(train, f"{prefix}_{k}")
    for c in ("tau_est", "tau_est_smooth", "lr", "tokens_per_s", "samples_per_s", "grad_norm", "peak_mem_mb"):
        out[c] = _last(train, c)
    if val.height:
        out["val_step"] = _last(val, "step")
        for c in ("loss", *(f"full_acc_{k}" for k in range(K)), *(f"cond_acc_{k}" for k in range(K)), "tau_est"):
            out[f"val_{c}"] = _last(val, c)
        if "tau_est" in val.columns and val["tau_est"].drop_nulls().len():  # the train stage's choice: earliest best
            best = val.filter(pl.col("tau_est") == val["tau_est"].max()).row(0, named=True)
            out["best_val_step"], out["best_val_tau_est"] = best["step"], best["tau_est"]
    elapsed = _last(train, "elapsed_s")
    out["elapsed_h"] = elapsed / 3600 if elapsed is not None else None
    out["steps_per_s"] = _last(train, "steps_per_s")
    eta = train["eta_s"][-1] if "eta_s" in train.columns and train.height else None
    eta = float(eta) if eta is not None and math.isfinite(eta) else None
    out["eta_h"] = eta / 3600 if eta is not None else None
    t_last = _last(train, "time")
    if t_last is not None:
        out["last_record_age_min"] = (time.time() - t_last) / 60
        if eta is not None:
            out["finishes_at_unix"] = t_last + eta
    return {k: v for k, v in out.items() if v is not None}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == int(v) and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    return str(v)


def summary_table(runs: list[RunMetrics]) -> pl.DataFrame:
    """One table: a row per metric, a column per run, latest values formatted for reading."""
    per_run = [latest(r) for r in runs]
    metrics: dict[str, None] = {}
    for d in per_run:
        metrics.update(dict.fromkeys(d))
    cols: dict[str, list[str]] = {"metric": list(metrics)}
    for r, d in zip(runs, per_run, strict=True):
        vals = [_fmt(d[m]) if m in d else "" for m in metrics]
        if "finishes_at_unix" in d:
            vals[list(metrics).index("finishes_at_unix")] = datetime.fromtimestamp(d["finishes_at_unix"]).isoformat(
                sep=" ", timespec="minutes")
        cols[r.label] = vals
    return pl.DataFrame(cols).with_columns(
        pl.col("metric").replace("finishes_at_unix", "finishes_at (local time)"))


def hidden_states_mode(run: RunMetrics) -> str:
    """offline | online | hybrid for a local eagle3lib run (its manifest's train.hidden_states, written when the run
    starts), "" where unknown (a remote log, another trainer's)."""
    if run.source.ssh is not None or run.source.tensorboard:
        return ""
    m = read_manifest(Path(run.source.location).parent) or {}
    return str(((m.get("params") or {}).get("train") or {}).get("hidden_states", "offline" if m else ""))


def sources_table(runs: list[RunMetrics]) -> pl.DataFrame:
    return pl.DataFrame({
        "run": [r.label for r in runs],
        "hidden_states": [hidden_states_mode(r) for r in runs],
        "source": [r.source.location for r in runs],
        "format": [r.format for r in runs],
        "lines": [r.lines for r in runs],
        "records": [r.records for r in runs],
        "duplicates_dropped": [r.duplicates_dropped for r in runs],
        "torn_last_line": [r.torn_last_line for r in runs],
        "unreadable_lines": [r.bad_lines for r in runs],
    })


@dataclass
class LearningCurves:
    runs: list[RunMetrics]
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def frame(self) -> pl.DataFrame:
        return combined(self.runs)

    def summary(self) -> pl.DataFrame:
        return summary_table(self.runs)

    def sources(self) -> pl.DataFrame:
        return sources_table(self.runs)


def load_runs(cfg: LearningCurvesConfig, default: Path, copy_dir: Path | None = None) -> list[RunMetrics]:
    sources = expand_sources(cfg.sources, default, cfg.labels)
    return [load_run(s, cfg.format, cfg.smoothing, cfg.eta_window, cfg.total_steps, cfg.ssh_timeout_s, copy_dir)
            for s in sources]
