"""What the recipes notebook shows: one row per recipe (how it is served, what it cost to train, what it accepts and
how fast it decodes beside the verifier alone), acceptance per draft position, tau per category, and a plot."""

from __future__ import annotations

from typing import Any

import polars as pl


def recipes_table(result: dict[str, Any]) -> pl.DataFrame:
    """The side-by-side table: served as, parameters, training, the validation estimate and vLLM's tau and speedup
    per measured mode, greedy identity with the verifier alone; with recipes.seeds, tau pooled over the seeds with its
    interval over prompts, each seed's, and the difference to the first recipe with its verdict."""
    modes = result["modes"]
    rows = []
    reference = result["rows"][0]["recipe"] if result["rows"] else None  # what recipes.seeds compares each with
    for r in result["rows"]:
        row = {"recipe": r["recipe"], "served as": r["served_as"], "trainable parameters": r["parameters"],
               "steps": r["steps"], "train s": r["train_s"], "validation estimate": r["val_tau_est"]}
        for m in modes:
            row[f"vLLM tau {m}"] = r[f"tau_vllm_{m}"]
            if f"tau_vllm_{m}_seeds" in r:  # recipes.seeds: pooled over seeds, its interval over prompts, each seed's
                lo, hi = r[f"tau_vllm_{m}_interval"] or (None, None)
                row[f"{m} 95% interval"] = f"[{lo:.2f}, {hi:.2f}]" if lo is not None else None
                row[f"{m} per seed"] = ", ".join(f"{t:.2f}" if t is not None else "-" for t in r[f"tau_vllm_{m}_seeds"])
                row[f"{m} vs {reference}"] = _versus(r.get(f"vs_reference_{m}"))
        for m in modes:
            row[f"speedup {m}"] = r[f"speedup_{m}"]
        if "greedy" in modes:
            row["greedy identical"] = r["greedy_identical_frac"]
        row["trained"] = r["source"]
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def _versus(cmp: dict[str, Any] | None) -> str | None:
    """A recipe against the first: the difference, its interval, and whether the seeds and prompts support it."""
    if cmp is None or cmp["difference"] is None:
        return None
    lo, hi = cmp["difference_interval"] or (None, None)
    iv = f" [{lo:+.2f}, {hi:+.2f}]" if lo is not None else ""
    return f"{cmp['difference']:+.2f}{iv} {'supported' if cmp['supported'] else 'not told apart'}"


def serving_table(result: dict[str, Any]) -> pl.DataFrame:
    """How vLLM serves each recipe (--speculative-config without the model path) and what it changes in training."""
    return pl.DataFrame([{"recipe": r["recipe"], "speculative config": _spec(r["serving"]),
                          "train overrides": ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or
                          ("its own trainer (eagle3lib/training/dflash_loop.py)" if r["served_as"] == "dflash" else "–")}
                         for r in result["rows"]])


def _spec(serving: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in serving.items())


def positions_table(result: dict[str, Any], mode: str = "greedy") -> pl.DataFrame:
    """Acceptance at each draft position (the chance that drafts 1..j were all accepted), tau per category and per
    context-length bucket (when evaluate.context_buckets is set)."""
    rows = []
    for r in result["rows"]:
        row: dict[str, Any] = {"recipe": r["recipe"]}
        for j, rate in enumerate(r.get(f"accept_rate_pos_{mode}") or [], 1):
            row[f"position {j}"] = rate
        for cat, tau in sorted((r.get(f"tau_by_category_{mode}") or {}).items()):
            row[f"tau {cat}"] = tau
        for bucket, tau in (r.get(f"tau_by_context_{mode}") or {}).items():  # evaluate.context_buckets
            row[f"tau context {bucket}"] = tau
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def plot_recipes(result: dict[str, Any]):
    """Left: tau per recipe, vLLM per mode (bars) and the validation estimate (marker). Right: acceptance per draft
    position, greedy (where the recipes part: a parallel or block drafter loses the later positions)."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows, modes = result["rows"], result["modes"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(len(rows))
    w = 0.8 / len(modes)
    for i, m in enumerate(modes):
        taus = [r[f"tau_vllm_{m}"] or 0 for r in rows]
        ivs = [r.get(f"tau_vllm_{m}_interval") for r in rows]  # recipes.seeds: the 95% interval over prompts
        err = np.array([[t - iv[0], iv[1] - t] if iv else [0, 0] for t, iv in zip(taus, ivs, strict=True)]).T
        ax.bar(x + (i - (len(modes) - 1) / 2) * w, taus, w, label=f"vLLM {m}", color=f"C{i}",
               yerr=err if any(ivs) else None, capsize=3)
    ax.plot(x, [r["val_tau_est"] or np.nan for r in rows], "D", color="k", mfc="none", label="validation estimate")
    ax.set_xticks(x, [f"{r['recipe']}\n({r['served_as']})" for r in rows], fontsize=8)
    ax.set_ylabel("tau (tokens per verification)")
    ax.set_ylim(1.0, result["ttt_steps"] + 1.0)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"K = {result['ttt_steps']}, {result['prompts']} prompts")
    mode = "greedy" if "greedy" in modes else modes[0]
    for i, r in enumerate(rows):
        rates = r.get(f"accept_rate_pos_{mode}") or []
        bx.plot(range(1, len(rates) + 1), rates, "o-", color=f"C{i % 10}", label=r["recipe"])
    bx.set_xlabel("draft position")
    bx.set_ylabel(f"acceptance ({mode})")
    bx.set_xticks(range(1, result["ttt_steps"] + 1))
    bx.set_ylim(0, 1)
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
