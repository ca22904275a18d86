"""The compare_runs stage: several runs side by side (eagle3lib/analysis/compare.py), written as CSV tables and a plot,
with each run's headline figures in the manifest."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from eagle3lib.analysis.compare import (
    RunSummary,
    acceptance_table,
    categories_table,
    cost_table,
    find_runs,
    load_summary,
    plot,
    positions_table,
    throughput_table,
)
from eagle3lib.config.stages import StageContext
from eagle3lib.core.atomic import write_text_atomic
from eagle3lib.core.paths import runs_root


@dataclass
class Comparison:
    runs: list[RunSummary]
    tables: dict[str, pl.DataFrame]

    def runs_table(self) -> pl.DataFrame:
        return pl.DataFrame([{"run": r.label, "stages complete": ", ".join(r.figures) or "none"} for r in self.runs])


def run(ctx: StageContext) -> Comparison:
    cfg = ctx.cfg
    timer = ctx.timer()
    paths = find_runs(cfg.runs, ctx.run_dir, runs_root())
    if cfg.labels and len(cfg.labels) != len(paths):
        raise ValueError(f"compare_runs.labels has {len(cfg.labels)} names for {len(paths)} runs: {[p.name for p in paths]}")
    runs = [load_summary(p, cfg.labels[i] if cfg.labels else None) for i, p in enumerate(paths)]
    seen: dict[str, int] = {}
    for r in runs:  # table columns need distinct names
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} #{seen[r.label]}"
    tables = {"acceptance": acceptance_table(runs), "positions": positions_table(runs),
              "categories": categories_table(runs), "throughput": throughput_table(runs), "cost": cost_table(runs)}
    outputs = {}
    for name, frame in tables.items():
        write_text_atomic(ctx.dir / f"{name}.csv", frame.write_csv())
        outputs[name] = f"{name}.csv"
    import matplotlib.pyplot as plt

    fig = plot(runs)
    fig.savefig(ctx.dir / "comparison.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    outputs["plot"] = "comparison.png"
    figures: dict[str, float | int | None] = {"runs": len(runs)}
    for r in runs:
        ev, tr = r.figures.get("evaluate", {}), r.figures.get("train", {})
        figures[f"{r.label}.tau_vllm_greedy"] = ev.get("tau_vllm_greedy")
        figures[f"{r.label}.val_tau_est"] = tr.get("val_tau_est")
        figures[f"{r.label}.train_tokens_per_s"] = tr.get("tokens_per_s")
    timer.finish(figures, outputs)
    return Comparison(runs, tables)
