"""Tables, sentences and plots of the deployment stage (eagle3lib/stages/deployment.py): the modelled speedup per K
and concurrency on each machine, the schedule each implies, and the model against the CPU grid and published figures."""

from __future__ import annotations

import json
from typing import Any

import matplotlib.pyplot as plt
import polars as pl

from eagle3lib.reports.concurrency import ranges_sentence
from eagle3lib.vllm.speculative_config import speculative_config

MODEL_LABEL = "MODEL (eagle3lib/analysis/decode_time.py), not a measurement"
SMALL = 1e8  # verifier parameters below which a GPU decode step is all fixed overhead (the tiny verifiers: 3-6M)


def schedules_markdown(out: dict[str, Any], model: str = "<verifier>", drafter: str = "<drafter>") -> str:
    """The one-line answer per machine, and its `--speculative-config`."""
    lines = [f"**Modelled** ({MODEL_LABEL}; acceptance from {out['inputs']['acceptance_source']}):", ""]
    if out["inputs"]["verifier_total_params"] < SMALL:
        lines[-1:] = ["", f"(A verifier of {out['inputs']['verifier_total_params'] / 1e6:.1f}M parameters is all per-step "
                      "overhead on a GPU, so speculation cannot pay there; `--profile kimi-k2.5 --stages deployment` "
                      "plans a large one.)", ""]
    for name, s in out["schedules"].items():
        top = max(s["best_k"].values())
        if top == 0:
            lines.append(f"- **{name}**: speculation costs more than it saves at every modelled concurrency.")
            continue
        spec = {**speculative_config(drafter, top), "num_speculative_tokens_per_batch_size": s["schedule"]}
        lines.append(f"- **{name}**: {ranges_sentence(s['schedule'], name)}  \n"
                     f"  `vllm serve {model} --speculative-config '{json.dumps(spec)}'`")
    return "\n".join(lines)


def inputs_table(out: dict[str, Any]) -> pl.DataFrame:
    """What the model was fed, and the efficiency settings."""
    rows = [{"input": k, "value": str(v)} for k, v in {**out["inputs"], **out["settings"]}.items()]
    return pl.DataFrame(rows)


def model_table(out: dict[str, Any], hardware: str) -> pl.DataFrame:
    """Modelled speedup per concurrency (rows) and K (columns) on one machine."""
    df = pl.DataFrame([r for r in out["model"] if r["hardware"] == hardware and r["ttt_steps"]])
    return df.pivot(on="ttt_steps", index="concurrency", values="speedup").rename(
        lambda c: c if c == "concurrency" else f"K={c}")


def plot_model(out: dict[str, Any]):
    """Modelled speedup over the verifier alone against concurrency, one panel per machine, one line per K; the
    schedule's choice at each concurrency starred."""
    names = out["hardware"]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in out["model"] if r["hardware"] == name]
        cs = sorted({r["concurrency"] for r in rows})
        for k in sorted({r["ttt_steps"] for r in rows if r["ttt_steps"]}):
            pts = sorted((r["concurrency"], r["speedup"]) for r in rows if r["ttt_steps"] == k)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"K = {k}")
        best = out["schedules"][name]["best_k"]
        by = {(r["ttt_steps"], r["concurrency"]): r["speedup"] for r in rows}
        ax.plot(cs, [by[(best[c], c)] if best[c] else 1.0 for c in cs], "k*", ms=9, label="schedule")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs], fontsize=7)
        ax.set_xlabel("concurrency (requests decoding at once)")
        ax.set_title(f"{name} (model)", fontsize=9)
    axes[0][0].set_ylabel("speedup over the verifier alone")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_cpu(out: dict[str, Any]):
    """The cpu-2core model against the measured grid: measured (solid), roofline model (dashed), the model with the
    per-forward overhead fitted to one measured number (dotted)."""
    rows = out["cpu_comparison"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, k in enumerate(sorted({r["ttt_steps"] for r in rows})):
        pts = sorted((r["concurrency"], r) for r in rows if r["ttt_steps"] == k)
        cs = [p[0] for p in pts]
        color = f"C{i}"
        ax.plot(cs, [p[1]["measured_speedup"] for p in pts], "o-", color=color, label=f"K = {k} measured")
        ax.plot(cs, [p[1]["model_speedup"] for p in pts], "--", color=color, alpha=0.6)
        ax.plot(cs, [p[1]["model_fitted_overhead_speedup"] for p in pts], ":", color=color, alpha=0.9)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    cs = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup over the verifier alone")
    ax.set_title("cpu-2core: measured (solid), model (dashed), model + fitted overhead (dotted)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def comparison_table(rows: list[dict[str, Any]], measured: str) -> pl.DataFrame | str:
    if not rows:
        return "No measured grid in this run (evaluate.concurrency_sweep measures one on this machine)."
    df = pl.DataFrame(rows)
    return df.with_columns((pl.col("model_speedup") / pl.col(measured)).alias("model_over_measured"))
