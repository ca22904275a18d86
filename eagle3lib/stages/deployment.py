"""The deployment stage: which K to serve at which concurrency on each machine of params/hardware.yaml. A decode-round
MODEL (eagle3lib/analysis/decode_time.py) with this run's measured acceptance, the schedule it implies per hardware row,
and the model held against what was measured: this run's CPU concurrency grid (the cpu-2core row) and published GPU
figures (eagle3lib/analysis/published_speedups.py: speedup against batch; published_decode.py: absolute decode speed
of large MoE verifiers). The analysis is eagle3lib/analysis/deployment.py."""

from __future__ import annotations

from typing import Any

import polars as pl

from eagle3lib.analysis.deployment import (
    CPU_ROW,
    build_plan,
    check_published_rows,
    cpu_comparison,
    fit_sentence,
    fit_summary,
    hardware_names,
    machine,
    read_results,
    schedule,
    source_run,
)
from eagle3lib.analysis.hardware import get_row, load_hardware, resolve_path
from eagle3lib.analysis.published_decode import PUBLISHED_DECODE, predict_decode
from eagle3lib.analysis.published_speedups import PUBLISHED, predict
from eagle3lib.config.stages import StageContext
from eagle3lib.core.atomic import write_json_atomic, write_text_atomic


def run(ctx: StageContext) -> dict[str, Any]:
    """The stage: model every hardware row, derive its schedule, compare with the CPU grid and published figures."""
    cfg = ctx.cfg
    timer = ctx.timer()
    table = load_hardware(resolve_path(cfg.hardware_file))
    names = hardware_names(cfg, ctx.profile, table)
    check_published_rows(cfg, table)
    src = source_run(cfg, ctx.run_dir)
    results = read_results(src)
    plan, inputs = build_plan(cfg, ctx.profile, src, results)
    rows: list[dict[str, Any]] = []
    schedules: dict[str, Any] = {}
    fit: dict[str, Any] = {}
    for name in names:
        hw = get_row(table, name, cfg.hardware_file)
        fit[name] = fit_summary(plan, hw, cfg.concurrencies)
        fit[name]["note"] = fit_sentence(name, fit[name])
        if not fit[name]["fits"]:  # weights alone overflow it: nothing to model, no schedule to deploy
            continue
        r = plan.rows(machine(hw, cfg), cfg.concurrencies, cfg.ttt_steps, name, hw)
        rows += r
        if fit[name]["max_concurrency"] is not None:
            schedules[name] = schedule(r)
    grid = (results or {}).get("concurrency_grid")
    cpu = cpu_comparison(plan, table[CPU_ROW], cfg, grid) if grid and CPU_ROW in table else []
    published = [r for p in PUBLISHED for r in predict(p, machine(table[p.hardware], cfg, gpus=1))]
    decode = [predict_decode(p, cfg) for p in PUBLISHED_DECODE]  # absolute speed, this section's settings
    out = {"inputs": inputs, "hardware": names, "model": rows, "schedules": schedules, "capacity": fit,
           "cpu_comparison": cpu, "published": published, "published_decode": decode, "grid": grid,
           "settings": {k: getattr(cfg, k) for k in ("bandwidth_efficiency", "flops_efficiency", "step_overhead_ms",
                                                    "tp_layer_overhead_us")}}
    write_json_atomic(ctx.dir / "results.json", out)
    outputs = {"results": "results.json"}
    for name, data in (("model", rows), ("cpu_comparison", cpu), ("published", published),
                       ("published_decode", decode)):
        if data:
            write_text_atomic(ctx.dir / f"{name}.csv", pl.DataFrame(data).write_csv())
            outputs[name] = f"{name}.csv"
    timer.finish(figures(out, cfg.concurrencies), outputs)
    return out


def figures(out: dict[str, Any], concurrencies: list[int]) -> dict[str, Any]:
    """Flat manifest figures: per hardware row whether it holds the weights (GB needed and available) and the largest
    concurrency whose KV cache it holds (0 = none), the best K at each concurrency it holds and where speculation stops
    paying (0 = it pays everywhere modelled), the model-vs-measurement ratios."""
    f: dict[str, Any] = {"hardware_rows": len(out["hardware"]), "modelled_points": len(out["model"]),
                         "points_that_fit": sum(1 for r in out["model"] if r.get("fits", True))}
    for name, fit in out.get("capacity", {}).items():
        f[f"{name}.fits"] = fit["fits"]
        f[f"{name}.weights_gb"], f[f"{name}.available_gb"] = fit["weights_gb"], fit["available_gb"]
        f[f"{name}.max_concurrency"] = fit["max_concurrency"] or 0
    for name, s in out["schedules"].items():
        f[f"{name}.stops_paying_at"] = s["stops_paying_at"] or 0
        for c in concurrencies:
            if c in s["best_k"]:
                f[f"{name}.best_k_c{c}"] = s["best_k"][c]
        c0 = min(s["best_k"])
        best = [r for r in out["model"] if r["hardware"] == name and r["ttt_steps"] == s["best_k"][c0]
                and r["concurrency"] == c0]
        f[f"{name}.speedup_c{c0}"] = round(best[0]["speedup"], 4)
    for key, rows, meas in (("cpu", out["cpu_comparison"], "measured_speedup"),
                            ("published", out["published"], "published_speedup")):
        if rows:
            ratios = sorted(r["model_speedup"] / r[meas] for r in rows)
            f[f"{key}_model_over_measured_median"] = round(ratios[len(ratios) // 2], 4)
            f[f"{key}_model_over_measured_max"] = round(ratios[-1], 4)
            f[f"{key}_model_over_measured_min"] = round(ratios[0], 4)
    checks = sorted(r["model_over_published"] for r in out["published_decode"] if not r["fitted"])
    if checks:  # model tokens/s over measured, at the points the tensor-parallel term was not fitted to
        f["decode_model_over_measured_min"] = round(checks[0], 4)
        f["decode_model_over_measured_max"] = round(checks[-1], 4)
    if out["cpu_comparison"]:
        ratios = sorted(r["model_fitted_overhead_speedup"] / r["measured_speedup"] for r in out["cpu_comparison"])
        f["cpu_fitted_model_over_measured_median"] = round(ratios[len(ratios) // 2], 4)
        f["cpu_fitted_overhead_ms"] = round(out["cpu_comparison"][0]["fitted_overhead_ms"], 3)
    return f

