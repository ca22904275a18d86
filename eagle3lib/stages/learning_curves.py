"""The learning_curves stage: how is training going? Every configured run's metrics (this run's by default), the
latest values as summary.csv, and the figures in the manifest; the notebook plots them (eagle3lib/analysis/plots.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.analysis.curves import LearningCurves, latest, load_runs, ttt_steps
from eagle3lib.config.stages import StageContext
from eagle3lib.core.atomic import write_text_atomic


def run(ctx: StageContext) -> LearningCurves:
    """The stage: load every configured run, write the summary (CSV) and the manifest, return the data to plot."""
    timer = ctx.timer()
    runs = load_runs(ctx.cfg, ctx.stage_dir("train") / "metrics.jsonl", ctx.dir / "fetched")
    lc = LearningCurves(runs)
    figures: dict[str, Any] = {"runs": len(runs), "records": sum(r.records for r in runs),
                               "duplicates_dropped": sum(r.duplicates_dropped for r in runs),
                               "torn_last_lines": sum(r.torn_last_line for r in runs),
                               "unreadable_lines": sum(r.bad_lines for r in runs)}
    for i, r in enumerate(runs):
        prefix = "" if i == 0 else f"run{i}."
        figures[f"{prefix}ttt_steps"] = ttt_steps(r.frame)
        figures.update({f"{prefix}{k}": v for k, v in latest(r).items() if k != "last_record_age_min"})
    lc.figures = figures
    write_text_atomic(ctx.dir / "summary.csv", lc.summary().write_csv())
    outputs = {"summary": "summary.csv"}
    copies = [r.local_copy for r in runs if r.local_copy]
    if copies:
        outputs["fetched"] = [str(Path(c).relative_to(ctx.dir)) for c in copies]
    timer.finish(figures, outputs)
    return lc
