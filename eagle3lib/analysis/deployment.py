"""Which K to serve at which concurrency on which machine: the decode-round model (eagle3lib/analysis/decode_time.py, a
MODEL, labelled so everywhere) applied to a profile's verifier and drafter on every hardware row, the schedule it
implies, and how far it is from measurements: this run's CPU grid (the cpu-2core row) and published GPU figures.

A row that cannot hold the verifier's and drafter's weights gets no schedule, and a point whose KV cache it cannot
hold is marked and left out of the schedule (eagle3lib/analysis/capacity.py).

Acceptance comes from measurements where the run has them (the evaluate stage's grid, else its K sweep, else its main
pass), else from `deployment.acceptance_per_position`; the model does not predict acceptance, only time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eagle3lib.analysis.capacity import GB, Capacity, capacity
from eagle3lib.analysis.decode_time import DrafterCost, Machine, VerifierCost, chained, speedup, tau_of
from eagle3lib.analysis.hardware import HardwareRow
from eagle3lib.config.deployment import DeploymentConfig, VerifierShape
from eagle3lib.config.profile import ParamsError, Profile
from eagle3lib.model.drafter_shape import DrafterShape, choose_drafter_layer, drafter_config_from
from eagle3lib.model.verifier import resolve_model
from eagle3lib.vllm.k_schedule import fastest_k, schedule_ranges

SHAPE_KEYS = tuple(VerifierShape.model_fields)
CPU_ROW = "cpu-2core"  # the hardware row of the machine the grid is measured on


def verifier_shape_from(model_path: str, trust_remote_code: bool = False) -> VerifierShape:
    """The shape from the verifier's config.json (its text_config for multimodal wrappers)."""
    from eagle3lib.model.verifier import load_config

    c = load_config(model_path, trust_remote_code)
    vals = {k: getattr(c, k) for k in SHAPE_KEYS if getattr(c, k, None) is not None and not k.endswith("_bytes")}
    if not getattr(c, "n_routed_experts", None):  # dense: the MoE fields of a config class default to non-zero
        for k in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
                  "first_k_dense_replace"):
            vals.pop(k, None)
    return VerifierShape(**vals)


def drafter_shape_for(train_cfg, shape: VerifierShape, ckpt: Path | None = None) -> DrafterShape:
    """The run's trained drafter when it exists, else the drafter the train section would build for this verifier
    (on a GPU host: "auto" picks the Llama layer there)."""
    if ckpt is not None and (Path(ckpt) / "config.json").exists():
        from eagle3lib.model.checkpoint import read_config

        return DrafterShape.of(read_config(ckpt))
    layer = choose_drafter_layer(train_cfg.drafter_layer, shape, cuda=True)
    vocab = train_cfg.draft_vocab_size or shape.vocab_size
    return DrafterShape.of(drafter_config_from(train_cfg, shape, [0], vocab, "verifier", layer))


def machine(row, cfg: DeploymentConfig, gpus: int | None = None) -> Machine:
    """A params/hardware.yaml row as the model's machine (tensor parallel over all its GPUs unless `gpus`)."""
    return machine_from(gpus or row.count, row.mem_bw_tbs, row.bf16_tflops, cfg)


def machine_from(gpus: int, mem_bw_tbs: float, bf16_tflops: float, cfg: DeploymentConfig) -> Machine:
    """The model's machine from per-GPU figures, tensor parallel over `gpus`, with the deployment section's
    efficiencies and overheads (the tensor-parallel cost per layer only when there is more than one GPU)."""
    return Machine(gpus=gpus, bandwidth=mem_bw_tbs * 1e12, flops=bf16_tflops * 1e12,
                   bandwidth_efficiency=cfg.bandwidth_efficiency, flops_efficiency=cfg.flops_efficiency,
                   overhead_s=cfg.step_overhead_ms / 1e3,
                   layer_overhead_s=cfg.tp_layer_overhead_us / 1e6 if gpus > 1 else 0.0)


def measured_acceptance(results: dict[str, Any] | None) -> tuple[list[float], str] | None:
    """Acceptance per position from the evaluate stage's results (rounds reaching position i): the grid's largest K
    averaged over its concurrencies, else the K sweep's largest K, else the main greedy pass."""
    if not results:
        return None
    grid = results.get("concurrency_grid") or {}
    for rows, label in ((grid.get("rows"), "the evaluate stage's concurrency grid"),
                        ((results.get("k_sweep") or {}).get("rows"), "the evaluate stage's K sweep")):
        spec = [r for r in rows or [] if r.get("ttt_steps") and r.get("accept_rate_pos_1") is not None]
        if spec:
            k = max(r["ttt_steps"] for r in spec)
            top = [r for r in spec if r["ttt_steps"] == k]
            return [sum(r[f"accept_rate_pos_{i}"] for r in top) / len(top) for i in range(1, k + 1)], f"{label}, K = {k}"
    greedy = ((results.get("vllm") or {}).get("greedy") or {})
    if greedy.get("accept_rate_pos") and None not in greedy["accept_rate_pos"]:
        return list(greedy["accept_rate_pos"]), "the evaluate stage's vLLM greedy pass"
    return None


def acceptance(cfg: DeploymentConfig, results: dict[str, Any] | None) -> tuple[list[float], str]:
    """(rates of rounds reaching each position, where they come from)."""
    if cfg.acceptance_per_position is not None:
        return chained(cfg.acceptance_per_position), cfg.acceptance_note or "deployment.acceptance_per_position"
    got = measured_acceptance(results)
    if got is None:
        raise ValueError("deployment: no acceptance to plan with: this run has no evaluate results with acceptance per "
                         "position (run --stages evaluate) and deployment.acceptance_per_position is not set")
    return got


@dataclass
class Plan:
    verifier: VerifierCost
    drafter: DrafterCost
    rates: list[float]  # share of rounds reaching draft position i
    context: int  # KV tokens per request
    utilisation: float = 0.9  # share of each GPU's memory vLLM takes (verifier.gpu_memory_utilization)

    def tau(self, k: int) -> float:
        return tau_of(self.rates, k)

    def capacity(self, row: HardwareRow, concurrency: int, k: int) -> Capacity:
        """Memory needed against available on hardware row `row` (tensor parallel over its GPUs) at one point; K = 0
        serves without the drafter."""
        return capacity(self.verifier, self.drafter if k else None, row.count, row.mem_gb, self.utilisation,
                        concurrency, self.context)

    def rows(self, m: Machine, concurrencies: list[int], ks: list[int], label: str,
             row: HardwareRow | None = None) -> list[dict[str, Any]]:
        """Modelled tokens/s, time per output token and speedup per (K, concurrency); K = 0 is the verifier alone.
        With the hardware `row`, each point says whether its weights and KV cache fit (`fits`, GB needed/available)."""
        return [{"hardware": label, **speedup(self.verifier, self.drafter, m, c, k, self.tau(k), self.context),
                 **(self.capacity(row, c, k).summary() if row is not None else {})}
                for k in [0, *ks] for c in concurrencies]


def fit_summary(plan: Plan, row: HardwareRow, concurrencies: list[int]) -> dict[str, Any]:
    """Whether `row` holds the verifier and drafter weights at all, and the concurrencies whose KV cache it cannot
    hold (at the largest K: its drafter cache is the largest)."""
    c0 = plan.capacity(row, concurrencies[0], 1)
    dropped = [c for c in concurrencies if not plan.capacity(row, c, 1).fits]
    return {"fits": c0.weights_fit, "weights_gb": round(c0.weights / GB, 1),
            "available_gb": round(c0.available / GB, 1), "gpus": row.count, "mem_gb_per_gpu": row.mem_gb,
            "gpu_memory_utilization": plan.utilisation,
            "kv_gb_per_request": round(c0.kv_cache / concurrencies[0] / GB, 3), "context_tokens": plan.context,
            "max_concurrency": max((c for c in concurrencies if c not in dropped), default=None),
            "dropped_concurrencies": dropped}


def fit_sentence(name: str, fit: dict[str, Any]) -> str:
    """What a machine cannot hold, in words; "" when it holds every modelled point."""
    if not fit["fits"]:
        return (f"{name} does not fit: the weights need {fit['weights_gb']:,.1f} GB, {fit['available_gb']:,.1f} GB "
                f"available ({fit['gpus']} x {fit['mem_gb_per_gpu']:g} GB x gpu_memory_utilization "
                f"{fit['gpu_memory_utilization']:g}); no schedule")
    if not fit["dropped_concurrencies"]:
        return ""
    cs = ", ".join(f"{c:,}" for c in fit["dropped_concurrencies"])
    return (f"{name}: the KV cache of {cs} requests does not fit ({fit['kv_gb_per_request']:.2f} GB per request of "
            f"{fit['context_tokens']:,} tokens as vLLM holds it over {fit['gpus']} GPUs, "
            f"{fit['available_gb'] - fit['weights_gb']:,.1f} GB left after the weights): those points are dropped "
            "from the schedule")


def schedule(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The modelled schedule as vLLM ranges, and the concurrency above which speculation stops paying (None: it pays
    at every modelled concurrency). Points marked as not fitting in memory (`fits` False) are left out."""
    bk = fastest_k([r for r in rows if r.get("fits", True)])
    stops = next((c for c, k in bk.items() if k == 0 and all(v == 0 for cc, v in bk.items() if cc >= c)), None)
    return {"best_k": bk, "schedule": schedule_ranges(bk), "stops_paying_at": stops}


def cpu_comparison(plan: Plan, row, cfg: DeploymentConfig, grid: dict[str, Any]) -> list[dict[str, Any]]:
    """The model on the cpu-2core row against the measured grid, per (K, concurrency): pure roofline (the configured
    overhead) and with the per-forward overhead fitted to one number, the verifier alone's time per output token at
    the grid's smallest concurrency."""
    measured = {(r["ttt_steps"], r["concurrency"]): r for r in grid["rows"]}
    cs = sorted({c for _, c in measured})
    ks = sorted({k for k, _ in measured if k})
    roof = machine(row, cfg)
    no_overhead = replace(roof, overhead_s=0.0)
    t0 = measured[(0, cs[0])]["tpot_ms"] / 1e3 * cs[0]  # one verifier step at the smallest batch
    step = no_overhead.seconds(*plan.verifier.step(cs[0], 1, plan.context))
    fitted = replace(roof, overhead_s=max(0.0, t0 - step))
    out = []
    for k in ks:
        for c in cs:
            m = measured.get((k, c))
            if not m or m.get("speedup") is None:
                continue
            tau = m.get("tau") or plan.tau(k)
            a = speedup(plan.verifier, plan.drafter, roof, c, k, tau, plan.context)
            b = speedup(plan.verifier, plan.drafter, fitted, c, k, tau, plan.context)
            out.append({"ttt_steps": k, "concurrency": c, "tau": tau, "measured_speedup": m["speedup"],
                        "model_speedup": a["speedup"], "model_fitted_overhead_speedup": b["speedup"],
                        "fitted_overhead_ms": 1e3 * fitted.overhead_s})
    return out


def hardware_names(cfg: DeploymentConfig, profile: Profile, table: dict[str, Any]) -> list[str]:
    """deployment.hardware, else cost_projection.hardware, else every GPU row (the CPU row is the grid's comparison);
    a named row the table lacks is an error naming the setting that named it."""
    from eagle3lib.analysis.hardware import get_row

    names, key = cfg.hardware, "deployment.hardware"
    if not names:
        key = "cost_projection.hardware (deployment.hardware is empty)"
        try:
            names = profile.section("cost_projection").hardware
        except ParamsError:
            names = []
    for name in names:
        get_row(table, name, cfg.hardware_file, key)
    return list(names or [n for n in table if n != CPU_ROW])


def check_published_rows(cfg: DeploymentConfig, table: dict[str, Any]) -> None:
    """The published GPU figures are modelled on rows of the shipped table; a table of one's own needs them too."""
    from eagle3lib.analysis.hardware import resolve_path
    from eagle3lib.analysis.published_speedups import PUBLISHED

    missing = sorted({p.hardware for p in PUBLISHED} - set(table))
    if missing:
        raise ValueError(f"deployment.hardware_file: {resolve_path(cfg.hardware_file)} has no row "
                         f"{', '.join(repr(m) for m in missing)}, the GPU of the published figures the model is checked "
                         "against (eagle3lib/analysis/published_speedups.py); copy it from params/hardware.yaml "
                         f"(rows it has: {', '.join(table)})")


def source_run(cfg: DeploymentConfig, run_dir: Path) -> Path:
    """The run the measurements come from (deployment.results_run_dir, else this one)."""
    from eagle3lib.analysis.cost import resolve_path

    if not cfg.results_run_dir:
        return run_dir
    src = resolve_path(cfg.results_run_dir)
    if not src.is_dir():  # not "this run has no evaluate results": a mistyped folder is no run at all
        raise ValueError(f"deployment.results_run_dir: no such folder: {src}")
    return src


def shapes(cfg: DeploymentConfig, profile: Profile,
           ckpt: Path | None) -> tuple[VerifierShape, DrafterShape, dict[str, str]]:
    """The verifier's shape (deployment.verifier_shape, else its config.json) and the drafter's (the checkpoint `ckpt`
    when it exists, else the train section's), with where each comes from."""
    vcfg = profile.verifier
    shape, src = cfg.verifier_shape, "deployment.verifier_shape"
    if shape is None:  # served in verifier.dtype: weights and cache in its bytes
        shape = verifier_shape_from(resolve_model(vcfg.model), vcfg.trust_remote_code)
        nbytes = 4.0 if vcfg.dtype == "float32" else 2.0
        shape = shape.model_copy(update={"weight_bytes": nbytes, "kv_cache_bytes": nbytes})
        src = f"{vcfg.model} config.json"
    have = ckpt is not None and (Path(ckpt) / "config.json").exists()
    dshape = drafter_shape_for(profile.section("train"), shape, ckpt if have else None)
    return shape, dshape, {"verifier_shape_source": src,
                           "drafter_source": "the trained drafter" if have else "the train section's shape"}


def build_plan(cfg: DeploymentConfig, profile: Profile, run_dir: Path,
               results: dict[str, Any] | None) -> tuple[Plan, dict[str, Any]]:
    """The model's inputs for `profile` (its deployment section `cfg`): the shapes, with the run's trained drafter when
    it has one, and the acceptance per position, with where each comes from."""
    shape, dshape, sources = shapes(cfg, profile, Path(run_dir) / "train" / "final")
    rates, rates_source = acceptance(cfg, results)
    vc, dc = VerifierCost(shape), DrafterCost(dshape, shape.weight_bytes)
    util = profile.verifier.gpu_memory_utilization
    inputs = {**sources, "acceptance_source": rates_source, "acceptance_per_position": rates,
              "verifier_total_params": vc.total_params, "verifier_active_params": vc.active_params,
              "drafter_params": dshape.parameters(), "context_tokens": cfg.context_tokens,
              "verifier_weights_gb": round(vc.weight_bytes_held / GB, 1),
              "drafter_weights_gb": round(dc.weight_bytes_held / GB, 2),
              "verifier_kv_bytes_per_token": vc.kv_bytes_per_token, "drafter_kv_bytes_per_token": dc.kv_bytes_per_token,
              "gpu_memory_utilization": util}
    return Plan(vc, dc, rates, cfg.context_tokens, util), inputs


def k_sweep_model(profile: Profile, ckpt: Path, concurrency: int) -> tuple[Callable[[int, float], float], str]:
    """The modelled GPU speedup of K drafts at acceptance length tau, for the evaluate stage's K sweep: the first
    hardware row of the deployment section at evaluate.concurrency."""
    from eagle3lib.analysis.hardware import get_row, load_hardware, resolve_path

    cfg = profile.section("deployment")
    table = load_hardware(resolve_path(cfg.hardware_file))
    name = hardware_names(cfg, profile, table)[0]
    shape, dshape, _ = shapes(cfg, profile, ckpt)
    row = get_row(table, name, cfg.hardware_file)
    vc, dc, m = VerifierCost(shape), DrafterCost(dshape, shape.weight_bytes), machine(row, cfg)
    cap = capacity(vc, dc, row.count, row.mem_gb, profile.verifier.gpu_memory_utilization, concurrency,
                   cfg.context_tokens)

    def model(k: int, tau: float) -> float:
        return speedup(vc, dc, m, concurrency, k, tau, cfg.context_tokens)["speedup"]

    held = "" if cap.fits else (f" (does not fit: {cap.needed / GB:,.0f} GB needed, {cap.available / GB:,.0f} GB "
                                "available)")
    return model, f"{name}, concurrency {concurrency}{held}"


def read_results(run_dir: Path) -> dict[str, Any] | None:
    p = Path(run_dir) / "evaluate" / "results.json"
    return json.loads(p.read_text()) if p.exists() else None
