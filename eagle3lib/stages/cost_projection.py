"""The cost_projection stage: what the full run costs on each machine of params/hardware.yaml, from this run's measured
throughputs (or hand-entered ones); the model itself is eagle3lib/analysis/cost.py."""

from __future__ import annotations

from eagle3lib.analysis.cost import CostProjection, project, resolve_path
from eagle3lib.config.profile import ParamsError
from eagle3lib.core.atomic import write_text_atomic
from eagle3lib.core.manifest import StageTimer


def run(ctx) -> CostProjection:
    """The stage: project the hero run onto every hardware row, write the tables and the manifest."""
    cfg = ctx.cfg
    timer = StageTimer(ctx.dir, ctx.manifest_params())
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
    timer.finish(cp.figures(), outputs)
    return cp
