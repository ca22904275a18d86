"""The cost_projection stage: what the full run costs on each machine of params/hardware.yaml, from this run's measured
throughputs (or hand-entered ones); the model itself is eagle3lib/analysis/cost.py."""

from __future__ import annotations

import polars as pl

from eagle3lib.analysis.cost import CostProjection, project, resolve_path
from eagle3lib.analysis.hidden_modes import hidden_modes
from eagle3lib.config.profile import ParamsError
from eagle3lib.config.stages import StageContext
from eagle3lib.core.atomic import write_text_atomic


def run(ctx: StageContext) -> CostProjection:
    """The stage: project the hero run onto every hardware row, write the tables and the manifest."""
    cfg = ctx.cfg
    timer = ctx.timer()
    run_dir = resolve_path(cfg.manifests_run_dir) if cfg.manifests_run_dir else ctx.run_dir
    train_ttt = None
    try:
        train_ttt = getattr(ctx.profile.section("train"), "ttt_steps", None)
    except ParamsError:  # the train section's module is not in this checkout
        pass
    cp = project(cfg, run_dir, train_ttt)
    outputs = {}
    for name, frame in (("projection", cp.table()), ("totals", cp.totals()), ("mfu", cp.mfu()),
                        ("breakeven", cp.breakeven()), ("inputs", cp.inputs())):
        write_text_atomic(ctx.dir / f"{name}.csv", frame.write_csv())
        outputs[name] = f"{name}.csv"
    figures = cp.figures()
    if {"extract", "train"} <= set(cp.measured):
        hm = modes(ctx, cp)
        write_text_atomic(ctx.dir / "hidden_modes.csv", hm.write_csv())
        outputs["hidden_modes"] = "hidden_modes.csv"
        for r in hm.iter_rows(named=True):
            key = f"hidden_states.{r['samples']}.{r['hardware']}.{r['mode']}"
            figures[f"{key}_usd"], figures[f"{key}_disk_tb"] = round(r["usd"], 2), round(r["disk_tb"], 4)
            if r["mode"] == "offline" and r["crossover_epochs"] is not None:
                figures[f"hidden_states.{r['samples']}.{r['hardware']}.crossover_epochs"] = round(r["crossover_epochs"], 3)
    timer.finish(figures, outputs)
    return cp


def modes(ctx: StageContext, cp: CostProjection) -> pl.DataFrame:
    """Offline vs online vs hybrid hidden states for the hero run (and cost_projection.hidden_states_samples)."""
    cfg = ctx.cfg
    budget = cfg.cache_budget_gb
    if budget is None:
        try:
            budget = ctx.profile.section("train").cache_budget_gb
        except ParamsError:
            budget = 0.0
    return hidden_modes(cp, budget, cfg.storage_usd_per_tb_month, cfg.storage_months,
                        [cfg.samples, *[n for n in cfg.hidden_states_samples if n != cfg.samples]])
