"""Seaborn figures for the analysis notebooks. Every function takes the library's polars frames, returns a matplotlib
Figure, and copes with missing columns (a panel without data says so) rather than failing inside seaborn."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
import pandas as pd
import polars as pl
import seaborn as sns
from matplotlib.lines import Line2D

if TYPE_CHECKING:
    from eagle3lib.analysis.cost import CostProjection

TTT_ROWS = (("loss", "loss"), ("full_acc", "full accuracy"), ("cond_acc", "conditional accuracy"))
X_LABEL = {"step": "step", "tokens_seen": "tokens seen", "elapsed_h": "elapsed (h)"}


def _pd(frame: pl.DataFrame, cols: list[str]) -> pd.DataFrame:
    """polars -> pandas without pyarrow (seaborn takes pandas)."""
    return pd.DataFrame({c: frame[c].to_list() for c in cols if c in frame.columns})


def _palette(labels: list[str]) -> dict[str, tuple]:
    return dict(zip(labels, sns.color_palette("tab10", max(len(labels), 1)), strict=False))


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in these logs", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(fig, palette: dict[str, tuple], raw: bool = True, val: bool = True) -> None:
    handles = [Line2D([], [], color=c, lw=2, label=lab) for lab, c in palette.items()]
    handles.append(Line2D([], [], color="k", lw=1.8, label="smoothed"))
    if raw:
        handles.append(Line2D([], [], color="k", lw=0.8, alpha=0.3, label="raw"))
    if val:
        handles.append(Line2D([], [], color="k", marker="D", ls="", label="validation"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 6), frameon=False,
               bbox_to_anchor=(0.5, 1.0))


def _curve(ax, frame: pl.DataFrame, x: str, y: str, palette: dict[str, tuple], log: bool = False) -> bool:
    """Raw (faint) and smoothed train curves per run, validation points on top. False when nothing to draw."""
    if y not in frame.columns or x not in frame.columns:
        return False
    sel = frame.filter(pl.col(x).is_not_null() & pl.col(y).is_not_null())
    train, val = sel.filter(pl.col("kind") == "train"), sel.filter(pl.col("kind") == "val")
    if not sel.height:
        return False
    smooth = f"{y}_smooth" if f"{y}_smooth" in frame.columns else y
    if train.height:
        t = _pd(train, ["run", x, y, smooth])
        if smooth != y:
            sns.lineplot(data=t, x=x, y=y, hue="run", palette=palette, ax=ax, legend=False, lw=0.8, alpha=0.3,
                         estimator=None, errorbar=None)
        sns.lineplot(data=t, x=x, y=smooth, hue="run", palette=palette, ax=ax, legend=False, lw=1.8,
                     estimator=None, errorbar=None)
    if val.height:
        sns.scatterplot(data=_pd(val, ["run", x, y]), x=x, y=y, hue="run", palette=palette, ax=ax, legend=False,
                        marker="D", s=36, edgecolor="k", zorder=5)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(X_LABEL.get(x, x))
    return True


def ttt_grid(frame: pl.DataFrame, x: str = "step") -> plt.Figure | None:
    """Per-TTT-step loss, full and conditional accuracy (rows) for each step k (columns), every run overlaid.
    None when no run logged `x` (speculators logs carry no tokens_seen)."""
    if x not in frame.columns or frame[x].drop_nulls().len() == 0:
        return None
    ks = sorted({int(m.group(1)) for c in frame.columns if (m := re.match(r"^loss_(\d+)$", c))})
    if not ks:
        return None
    runs = frame["run"].unique(maintain_order=True).to_list()
    palette = _palette(runs)
    fig, axes = plt.subplots(len(TTT_ROWS), len(ks), figsize=(3.6 * len(ks), 2.8 * len(TTT_ROWS)), squeeze=False,
                             sharex=True)
    for i, (prefix, title) in enumerate(TTT_ROWS):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            if not _curve(ax, frame, x, f"{prefix}_{k}", palette):
                _no_data(ax, f"{prefix}_{k}")
            ax.set_ylabel(title if j == 0 else "")
            if i == 0:
                ax.set_title(f"TTT step {k}")
            if prefix != "loss":
                ax.set_ylim(0, 1)
    _legend(fig, palette, val="val" in frame["kind"].to_list())
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def overview(frame: pl.DataFrame) -> plt.Figure:
    """Total loss, the tau estimate over time, lr, throughput, ETA and gradient norm, every run overlaid."""
    runs = frame["run"].unique(maintain_order=True).to_list()
    palette = _palette(runs)
    if "elapsed_s" in frame.columns:
        frame = frame.with_columns((pl.col("elapsed_s") / 3600).alias("elapsed_h"))
    if "eta_s" in frame.columns:
        frame = frame.with_columns((pl.col("eta_s") / 3600).alias("eta_h"))
    panels = (("step", "loss", "loss (weighted over TTT steps)", True),
              ("elapsed_h", "tau_est", "tau estimate (1 + sum of full accuracies)", False),
              ("step", "lr", "learning rate", False),
              ("step", "tokens_per_s", "training tokens/s", False),
              ("elapsed_h", "eta_h", "ETA to the end of the run (h)", False),
              ("step", "grad_norm", "gradient norm", True))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (x, y, title, log) in zip(axes.flat, panels, strict=True):
        if not _curve(ax, frame, x, y, palette, log=log):
            _no_data(ax, f"{y} (against {X_LABEL.get(x, x)})")
        ax.set_title(title)
        ax.set_ylabel("")
    _legend(fig, palette, val="val" in frame["kind"].to_list())
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def val_by_epoch(frame: pl.DataFrame) -> plt.Figure | None:
    """Validation tau estimate per epoch, each run's best marked: the checkpoint train/best/ holds (the earliest of a
    tie, as the train stage chooses). None when no run has validation records."""
    val = frame.filter(pl.col("kind") == "val") if "kind" in frame.columns else frame.clear()
    if not val.height or "tau_est" not in val.columns or "epoch" not in val.columns:
        return None
    runs = frame["run"].unique(maintain_order=True).to_list()
    palette = _palette(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for run in runs:
        v = val.filter(pl.col("run") == run).sort("step")
        if not v.height:
            continue
        ep, tau = v["epoch"].to_list(), v["tau_est"].to_list()
        ax.plot(ep, tau, marker="D", ms=4, color=palette[run], label=run)
        i = max(range(len(tau)), key=lambda j: (tau[j], -j))
        ax.plot([ep[i]], [tau[i]], marker="*", ms=16, color=palette[run], mec="k", ls="")
        ax.annotate(f"best {tau[i]:.2f}" + (" (last: still improving)" if i == len(tau) - 1 else ""),
                    (ep[i], tau[i]), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation tau estimate")
    ax.set_title("Checkpoint choice by acceptance (star: train/best/)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def served_vs_estimate(frame: pl.DataFrame) -> plt.Figure | None:
    """The served probes' measured tau (greedy: circles, sampled: triangles; train.served_eval_every) against the
    validation estimate (diamonds) by step: does the estimate the checkpoint choice reads track what serving gets?
    None when no run has probe records."""
    if "kind" not in frame.columns or not frame.filter(pl.col("kind") == "served").height:
        return None
    runs = frame["run"].unique(maintain_order=True).to_list()
    palette = _palette(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    series = (("val", "tau_est", "D", "-", "validation estimate"), ("served", "tau_greedy", "o", "-", "served, greedy"),
              ("served", "tau_sampled", "^", "--", "served, sampled"))
    for run in runs:
        for kind, col, marker, ls, _ in series:
            if col not in frame.columns:
                continue
            f = frame.filter((pl.col("run") == run) & (pl.col("kind") == kind) & pl.col(col).is_not_null()).sort("step")
            if f.height:
                ax.plot(f["step"].to_list(), f[col].to_list(), marker=marker, ls=ls, ms=5, color=palette[run], lw=1.2)
    handles = [Line2D([], [], color=c, lw=2, label=r) for r, c in palette.items()]
    handles += [Line2D([], [], color="k", marker=m, ls=ls, label=lab) for _, _, m, ls, lab in series]
    ax.legend(handles=handles, fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("tau (accepted tokens per verifier pass)")
    ax.set_title("Acceptance as served during training vs the validation estimate")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------- cost
def cost_overview(cp: CostProjection) -> plt.Figure:
    """Hours per hardware row stacked by stage, and cost, each with the range of the speed factor and price."""
    table = cp.table()
    stages = table.filter(pl.col("stage") != "total")
    totals = table.filter(pl.col("stage") == "total")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.6 * len(cp.rows) + 2.2))
    names = [r.name for r in cp.rows]
    left = dict.fromkeys(names, 0.0)
    for stage, color in zip(list(cp.measured), sns.color_palette("Set2", len(cp.measured)), strict=False):
        s = {r["hardware"]: r["hours"] for r in stages.filter(pl.col("stage") == stage).iter_rows(named=True)}
        a1.barh(names, [s[n] for n in names], left=[left[n] for n in names], color=color, label=stage)
        for n in names:
            left[n] += s[n]
    tot = {r["hardware"]: r for r in totals.iter_rows(named=True)}
    a1.errorbar([tot[n]["hours"] for n in names], names, fmt="none", ecolor="k", capsize=4,
                xerr=[[tot[n]["hours"] - tot[n]["hours_lo"] for n in names],
                      [tot[n]["hours_hi"] - tot[n]["hours"] for n in names]])
    a1.set(xlabel="wall-clock hours", title="time of the hero run (bar: estimate, whisker: range)")
    a1.legend(frameon=False)
    a1.invert_yaxis()
    usd = [tot[n]["usd"] for n in names]
    sns.barplot(x=usd, y=names, ax=a2, color=sns.color_palette("Set2")[3], orient="h")
    a2.errorbar(usd, range(len(names)), fmt="none", ecolor="k", capsize=4,
                xerr=[[tot[n]["usd"] - tot[n]["usd_lo"] for n in names], [tot[n]["usd_hi"] - tot[n]["usd"] for n in names]])
    for i, n in enumerate(names):
        a2.text(tot[n]["usd_hi"], i, f"  ${tot[n]['usd']:,.0f}", va="center")
    a2.set(xlabel="US$", title="cost of the hero run (owned hardware: $0/h)")
    fig.tight_layout()
    return fig


def sensitivity(cp: CostProjection, lo: float = 0.25, hi: float = 4.0) -> plt.Figure:
    """Cost and time against the average sequence length (every row) and against the speed factor (other rows)."""
    seq = cp.sensitivity_seq_len(lo, hi)
    spd = cp.sensitivity_speed()
    palette = _palette([r.name for r in cp.rows])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for col, (y, label) in enumerate((("hours", "wall-clock hours"), ("usd", "US$"))):
        ax = axes[0][col]
        sns.lineplot(data=_pd(seq, ["hardware", "avg_tokens_per_sample", y]), x="avg_tokens_per_sample", y=y,
                     hue="hardware", palette=palette, ax=ax, estimator=None, errorbar=None)
        ax.axvline(cp.spec.avg_tokens, color="gray", ls="--", lw=1)
        ax.set(xlabel="average tokens per sample (dashed: the hero spec)", ylabel=label,
               title=f"{label} vs sequence length", xlim=(0, None), ylim=(0, None))
        ax = axes[1][col]
        if not spd.height:
            _no_data(ax, "hardware other than the reference")
            continue
        sns.lineplot(data=_pd(spd, ["hardware", "speed_factor", y]), x="speed_factor", y=y, hue="hardware",
                     palette=palette, ax=ax, estimator=None, errorbar=None, legend=False)
        for r in spd.unique(subset=["hardware"], maintain_order=True).iter_rows(named=True):
            c = palette[r["hardware"]]
            ax.axvspan(r["range_lo"], r["range_hi"], color=c, alpha=0.08)
            ax.axvline(r["estimate"], color=c, ls=":", lw=1.2)
            at = spd.filter(pl.col("hardware") == r["hardware"]).row(0, named=True)
            scale = at["speed_factor"] / r["estimate"]  # hours and cost fall as 1/factor
            ax.scatter([r["estimate"]], [at[y] * scale], color=c, edgecolor="k", zorder=5, label=r["hardware"])
        ax.set(xscale="log", xlabel=f"speed factor vs {cp.reference.name} (dot: estimate, band: range)",
               ylabel=label, title=f"{label} vs speed factor")
        ax.legend(frameon=False)
        if y == "hours":
            ax.set_yscale("log")
    fig.tight_layout()
    return fig


def hidden_modes(frame: pl.DataFrame) -> plt.Figure:
    """$ of offline / online / hybrid hidden states per hardware row, one panel per hero-run size, disk TB on the
    offline bars (eagle3lib/analysis/hidden_modes.py)."""
    sizes = frame["samples"].unique(maintain_order=True).to_list()
    rows = frame["hardware"].unique(maintain_order=True).to_list()
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 0.55 * len(rows) * 3 + 1.8), squeeze=False)
    for ax, n in zip(axes[0], sizes, strict=True):
        part = frame.filter(pl.col("samples") == n)
        sns.barplot(data=_pd(part, ["hardware", "mode", "usd"]), x="usd", y="hardware", hue="mode", ax=ax,
                    orient="h", palette="Set2")
        for r in part.filter(pl.col("mode") == "offline").iter_rows(named=True):
            ax.text(r["usd"], rows.index(r["hardware"]) - 0.27, f"  {r['disk_tb']:,.2f} TB", va="center", fontsize=8)
        ax.set(xlabel="US$ (compute + storage)", ylabel="", title=f"{n:,} samples: hidden states stored or recomputed")
        ax.legend(frameon=False, title=None)
    fig.tight_layout()
    return fig
