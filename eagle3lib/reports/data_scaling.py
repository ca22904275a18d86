"""What the data-scaling notebook shows: the points and the fitted curve with its band, the target, and the points
as a table."""

from __future__ import annotations

from typing import Any

import polars as pl


def plot_scaling(result: dict[str, Any]):
    """Tau against training tokens (log axis): validation estimates with their standard error, vLLM measurements,
    reference points, the fitted curve with its 10-90% band and the ceiling, and the target."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.6))
    pts, curve, target = result["points"], result["curve"], result["target"]
    if curve:
        ax.fill_between(curve["grid_tokens"], curve["band_lo"], curve["band_hi"], color="C0", alpha=0.18,
                        label="10-90% band (refits to resampled points)")
        ax.plot(curve["grid_tokens"], curve["tau"], color="C0", label="fit: tau = 1 + (c - 1) / (1 + (T50/T)^b)")
        ax.axhline(curve["c"], color="C0", ls=":", lw=1, label=f"ceiling c = {curve['c']:.2f}")
    if pts:
        cross = all(p.get("scored_on", "").startswith("cross-fitted") for p in pts)
        ax.errorbar([p["train_tokens"] for p in pts], [p["val_tau_est"] for p in pts],
                    yerr=[p["val_tau_se"] for p in pts], fmt="o", color="C1", capsize=3,
                    label="validation estimate (cross-fitted; resampled s.e.)" if cross else
                    "validation estimate (best checkpoint; binomial s.e.)")
        v = [p for p in pts if p["tau_vllm_greedy"] is not None]
        if v:
            ax.plot([p["train_tokens"] for p in v], [p["tau_vllm_greedy"] for p in v], "s", color="C2", ms=7,
                    mfc="none", mew=2, label="vLLM greedy (measured)")
        for p in pts:
            ax.annotate(fraction_label(p["fraction"]), (p["train_tokens"], p["val_tau_est"]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8, color="C1")
    for r in result["reference_points"]:
        lo, hi = r["tau_range"] or (r["tau"], r["tau"])
        ax.errorbar([r["tokens"]], [r["tau"]], yerr=[[r["tau"] - lo], [hi - r["tau"]]], fmt="D", color="C3",
                    capsize=3, label=r["label"])
    t = target["target_tau"]
    ax.axhline(t, color="C3", ls="--", lw=1, label=f"target tau {t:.2f}")
    if target.get("tokens"):
        ax.axvline(target["tokens"], color="C3", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (one epoch of the training split)")
    ax.set_ylabel("acceptance length tau")
    ax.set_title("How much data buys how much acceptance")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def fraction_label(f: float) -> str:
    """1/64 rather than 0.015625."""
    inv = 1.0 / f
    return "all" if f == 1.0 else f"1/{inv:.0f}" if abs(inv - round(inv)) < 1e-9 else f"{f:g}"


def points_table(result: dict[str, Any]) -> pl.DataFrame:
    """One row per data size: how much data, how long it trained, what it reached."""
    rows = [{"fraction": fraction_label(p["fraction"]), "train_samples": p["train_samples"], "train_tokens": p["train_tokens"],
             "steps": p["steps"], "best_step": p["best_step"], "val_tau_est": p["val_tau_est"],
             "val_tau_se": p["val_tau_se"], "val_tau_best": p.get("val_tau_best"), "tau_vllm_greedy": p["tau_vllm_greedy"],
             "still_improving": p["still_improving"], "train_s": p["train_s"],
             # its samples generated and extracted at this run's rates plus its training, on this machine
             "cpu_hours_here": p.get("hours_here"),
             "trained": "reused" if p["reused"] else "here", "folder": p["dir"]} for p in result["points"]]
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()
