"""The concurrency grid and the K schedule of the evaluate stage (eagle3lib/evaluation/concurrency_grid.py), for its
notebook and the deployment notebook: a table, a plot of speedup against concurrency (one line per K, the served
schedule beside them), and the schedule in words and as the `vllm serve` line."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import polars as pl

from eagle3lib.reports.tables import people_text


def grid_table(grid: dict[str, Any] | None) -> pl.DataFrame | str:
    """One row per (K, concurrency); a sentence when no grid was measured."""
    if not grid:
        return "No concurrency grid in this run (evaluate.concurrency_sweep: [1, 2, 4, 8, 16, 32] measures one)."
    return pl.DataFrame(grid["rows"])


def schedule_table(grid: dict[str, Any] | None) -> pl.DataFrame | str:
    """The served schedule at every concurrency against the best fixed K there."""
    if not grid or not grid.get("per_concurrency"):
        return (grid or {}).get("note", "No schedule served.")
    best = grid["best_k"]
    return pl.DataFrame([{**r, "best_fixed_k": best[str(r["concurrency"])]} for r in grid["per_concurrency"]])


def ranges_sentence(schedule: list[list[int]], where: str) -> str:
    """'at concurrency <= N use K = a, up to M use K = b, above M speculation costs more than it saves on X'."""
    parts = []
    for i, (_, hi, k) in enumerate(schedule):
        last = i == len(schedule) - 1
        span = f"above {schedule[i - 1][1]}" if last and i else (f"at concurrency <= {hi}" if i == 0 else f"up to {hi}")
        parts.append(f"{span} speculation costs more than it saves" if k == 0 else f"{span} use K = {k}")
    return ", ".join(parts) + f" on {where}."


def schedule_markdown(grid: dict[str, Any] | None, where: str = "this machine") -> str:
    if not grid:
        return ""
    if not grid.get("schedule"):
        return grid.get("note", "")
    scores = grid["grid_score"]
    fixed = ", ".join(f"K = {k[1:]}: {v:.2f}" for k, v in scores.items() if k != "schedule")
    verdict = "beats" if grid["schedule_beats_every_fixed_k"] else "does **not** beat"
    derived = grid.get("derived_schedule")
    head = (f"**The grid's schedule**: {ranges_sentence(derived, where)}\n\n" if derived else
            "**The grid's schedule**: none (the verifier alone was fastest at every concurrency).\n\n")
    if grid.get("schedule_source") != "derived from the grid":
        head += f"**Served instead** ({grid.get('schedule_source')}): {ranges_sentence(grid['schedule'], where)}\n\n"
    return people_text(f"{head}Served and measured, it {verdict} every fixed K over the grid (geometric mean of tokens/s "
                       f"relative to the best fixed K at each concurrency: schedule {scores['schedule']:.2f}; {fixed}).\n\n"
                       f"Deploy it with:\n\n```\n{grid['serve_command']}\n```")  # the drafter's path: run-relative


def plot_grid(grid: dict[str, Any]):
    """Speedup over the verifier alone against concurrency, one line per K and the served schedule; time per output
    token against concurrency."""
    rows = grid["rows"]
    ks = sorted({r["ttt_steps"] for r in rows})
    cs = sorted({r["concurrency"] for r in rows})
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["ttt_steps"] == 0}
    for k in ks:
        pts = sorted((r["concurrency"], r["speedup"], r["tpot_ms"]) for r in rows if r["ttt_steps"] == k)
        label = "verifier alone" if k == 0 else f"K = {k}"
        if k:
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        b.plot([p[0] for p in pts], [p[2] for p in pts], "o-" if k else "k.--", label=label)
    if grid.get("per_concurrency"):
        pc = grid["per_concurrency"]
        a.plot([r["concurrency"] for r in pc], [r["tokens_per_s"] / base[r["concurrency"]] for r in pc], "k*--", ms=10,
               label="schedule (served)")
    a.axhline(1.0, color="gray", lw=0.8)
    for ax, title in ((a, "speedup over the verifier alone"), (b, "time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
