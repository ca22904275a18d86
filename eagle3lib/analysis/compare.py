"""Several runs side by side, from the manifests their stages wrote: acceptance length per method, per draft position
and per prompt category (evaluate), throughput per stage (generate, extract, train), and the projected cost of the
full run on each hardware row (cost_projection). A stage a run has not completed is a missing value, not an error.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.paths import REPO_ROOT

STAGES = ("generate", "extract", "train", "evaluate", "cost_projection")
THROUGHPUT = {"generate": "output_tokens_per_s", "extract": "tokens_per_s", "train": "tokens_per_s"}
METHODS = ("train_est", "val_est", "lib_greedy", "vllm_greedy", "vllm_sampled")


@dataclass
class RunSummary:
    label: str
    path: Path
    figures: dict[str, dict[str, Any]]  # stage -> figures of its manifest (complete stages only)
    wall_s: dict[str, float]  # stage -> wall seconds


def find_runs(specs: list[str], this_run: Path, runs_root: Path) -> list[Path]:
    """Run folders: the configured paths or globs (relative to the repo root), else this run and every other run
    under runs/ that has a completed stage, this run first."""
    if specs:
        out: list[Path] = []
        for s in specs:
            p = Path(s).expanduser()
            p = p if p.is_absolute() else REPO_ROOT / p
            hits = sorted(Path(m) for m in glob.glob(str(p))) if glob.has_magic(str(p)) else [p]
            if not hits or not all(h.is_dir() for h in hits):
                raise ValueError(f"compare_runs.runs: {s!r} names no run directory ({p})")
            out += hits
        return list(dict.fromkeys(out))
    others = sorted(d for d in runs_root.iterdir() if d.is_dir() and d.resolve() != this_run.resolve()
                    and any((d / s / "manifest.json").exists() for s in STAGES)) if runs_root.is_dir() else []
    return [this_run, *others]


def load_summary(path: Path, label: str | None = None) -> RunSummary:
    figures, wall = {}, {}
    for stage in STAGES:
        m = read_manifest(path / stage)
        if m and m.get("status") == "complete":
            figures[stage] = m.get("figures") or {}
            if m.get("wall_s") is not None:
                wall[stage] = float(m["wall_s"])
    return RunSummary(label or path.name, path, figures, wall)


def _labels(runs: list[RunSummary]) -> list[str]:
    return [r.label for r in runs]


def acceptance_table(runs: list[RunSummary]) -> pl.DataFrame:
    """tau per method (rows) and run (columns)."""
    rows = []
    for m in METHODS:
        vals = [r.figures.get("evaluate", {}).get(f"tau_{m}") for r in runs]
        if any(v is not None for v in vals):
            rows.append({"method": m, **dict(zip(_labels(runs), vals, strict=True))})
    return pl.DataFrame(rows, schema={"method": pl.String, **{lab: pl.Float64 for lab in _labels(runs)}})


def positions_table(runs: list[RunSummary], method: str = "vllm_greedy") -> pl.DataFrame:
    """The share of steps whose draft position k was accepted, per run (vLLM greedy by default)."""
    ks = sorted({int(m.group(1)) for r in runs for key in r.figures.get("evaluate", {})
                 if (m := re.fullmatch(rf"accept_rate_pos_(\d+)_{method}", key))})
    rows = [{"position": k, **{r.label: r.figures.get("evaluate", {}).get(f"accept_rate_pos_{k}_{method}")
                               for r in runs}} for k in ks]
    return pl.DataFrame(rows, schema={"position": pl.Int64, **{lab: pl.Float64 for lab in _labels(runs)}})


def categories_table(runs: list[RunSummary], side_mode: str = "vllm_greedy") -> pl.DataFrame:
    """tau per prompt category (chat, code, math, ...) and run."""
    cats = sorted({key.removeprefix(f"tau_{side_mode}_") for r in runs for key in r.figures.get("evaluate", {})
                   if key.startswith(f"tau_{side_mode}_")})
    rows = [{"category": c, **{r.label: r.figures.get("evaluate", {}).get(f"tau_{side_mode}_{c}") for r in runs}}
            for c in cats]
    return pl.DataFrame(rows, schema={"category": pl.String, **{lab: pl.Float64 for lab in _labels(runs)}})


def throughput_table(runs: list[RunSummary]) -> pl.DataFrame:
    """Tokens/s and wall time per stage and run."""
    rows = []
    for stage, key in THROUGHPUT.items():
        rows.append({"stage": stage, "figure": key,
                     **{r.label: r.figures.get(stage, {}).get(key) for r in runs}})
        rows.append({"stage": stage, "figure": "wall_s", **{r.label: r.wall_s.get(stage) for r in runs}})
    return pl.DataFrame(rows, schema={"stage": pl.String, "figure": pl.String,
                                      **{lab: pl.Float64 for lab in _labels(runs)}})


def cost_table(runs: list[RunSummary]) -> pl.DataFrame:
    """The projected full run per hardware row: hours and dollars, per run."""
    rows_ = sorted({key.split(".", 1)[0] for r in runs for key in r.figures.get("cost_projection", {})
                    if key.endswith(".total_usd")})
    rows = []
    for hw in rows_:
        for what in ("total_hours", "total_usd"):
            rows.append({"hardware": hw, "figure": what,
                         **{r.label: r.figures.get("cost_projection", {}).get(f"{hw}.{what}") for r in runs}})
    return pl.DataFrame(rows, schema={"hardware": pl.String, "figure": pl.String,
                                      **{lab: pl.Float64 for lab in _labels(runs)}})


def plot(runs: list[RunSummary]):
    """Left: accepted share per draft position; right: tau per prompt category (vLLM greedy)."""
    import matplotlib.pyplot as plt

    pos, cats = positions_table(runs), categories_table(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        if pos.height:
            a.plot(pos["position"], pos[r.label], marker="o", label=r.label)
        if cats.height:
            b.bar([j + i * width for j in range(cats.height)], cats[r.label].fill_null(0), width, label=r.label)
    a.set(xlabel="draft position", ylabel="accepted share of steps", title="acceptance per position (vLLM greedy)",
          ylim=(0, 1))
    b.set(xticks=[j + width * (len(runs) - 1) / 2 for j in range(cats.height)], xticklabels=cats["category"].to_list(),
          ylabel="tau (tokens per verifier step)", title="acceptance length per category (vLLM greedy)")
    for ax in (a, b):
        if ax.has_data():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no evaluate stage in these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig
