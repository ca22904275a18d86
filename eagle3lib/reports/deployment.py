"""Tables, sentences and plots of the deployment stage (eagle3lib/stages/deployment.py): the modelled speedup per K
and concurrency on each machine, the schedule each implies, and the model against the CPU grid and published figures."""

from __future__ import annotations

import json
from textwrap import fill
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
    fits = out.get("capacity", {})
    for name in out["hardware"]:
        note = fits.get(name, {}).get("note", "").removeprefix(name).lstrip(": ")
        s = out["schedules"].get(name)
        if s is None:  # nothing it can hold: the note says what it needs against what it has
            lines.append(f"- **{name}**: {note or 'no modelled point fits its memory'}.")
            continue
        held = f"  \n  Capacity: {note}." if note else ""
        top = max(s["best_k"].values())
        if top == 0:
            lines.append(f"- **{name}**: speculation costs more than it saves at every modelled concurrency.{held}")
            continue
        spec = {**speculative_config(drafter, top), "num_speculative_tokens_per_batch_size": s["schedule"]}
        lines.append(f"- **{name}**: {ranges_sentence(s['schedule'], name)}  \n"
                     f"  `vllm serve {model} --speculative-config '{json.dumps(spec)}'`{held}")
    return "\n".join(lines)


def inputs_table(out: dict[str, Any]) -> pl.DataFrame:
    """What the model was fed, and the efficiency settings."""
    rows = [{"input": k, "value": str(v)} for k, v in {**out["inputs"], **out["settings"]}.items()]
    return pl.DataFrame(rows)


def model_table(out: dict[str, Any], hardware: str) -> pl.DataFrame | str:
    """Modelled speedup per concurrency (rows) and K (columns) on one machine; a point whose weights and KV cache do
    not fit is left empty and its row says so (GB needed / available)."""
    rows = [r for r in out["model"] if r["hardware"] == hardware and r["ttt_steps"]]
    if not rows:
        return out.get("capacity", {}).get(hardware, {}).get("note") or f"{hardware}: nothing modelled"
    df = pl.DataFrame([{**r, "speedup": r["speedup"] if r.get("fits", True) else None} for r in rows])
    table = df.pivot(on="ttt_steps", index="concurrency", values="speedup").rename(
        lambda c: c if c == "concurrency" else f"K={c}")
    if "fits" not in df.columns:
        return table
    top = df.filter(pl.col("ttt_steps") == pl.col("ttt_steps").max())  # the largest drafter cache: the most memory
    memory = top.select("concurrency", pl.format("{} / {} GB{}", "memory_needed_gb", "memory_available_gb",
                                                 pl.when(pl.col("fits")).then(pl.lit("")).otherwise(
                                                     pl.lit(": does not fit"))).alias("memory"))
    return table.join(memory, on="concurrency")


def plot_model(out: dict[str, Any]):
    """Modelled speedup over the verifier alone against concurrency, one panel per machine, one line per K; the
    schedule's choice at each concurrency starred."""
    names = out["hardware"]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in out["model"] if r["hardware"] == name]
        if not rows:  # its weights do not fit: an empty panel that says so
            ax.text(0.5, 0.5, fill(out.get("capacity", {}).get(name, {}).get("note", "nothing modelled"), 34),
                    ha="center", va="center", transform=ax.transAxes, fontsize=8, color="C3")
            ax.set_title(f"{name}: does not fit", fontsize=9)
            ax.set_xticks([])
            continue
        cs = sorted({r["concurrency"] for r in rows})
        held = sorted({r["concurrency"] for r in rows if r.get("fits", True) and r["ttt_steps"]})
        for k in sorted({r["ttt_steps"] for r in rows if r["ttt_steps"]}):
            pts = sorted((r["concurrency"], r["speedup"], r.get("fits", True)) for r in rows if r["ttt_steps"] == k)
            line = ax.plot([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], "o-", ms=3, label=f"K = {k}")
            ax.plot([p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]], "x", ms=4,
                    color=line[0].get_color(), alpha=0.5)
        if len(held) < len(cs):  # beyond the largest concurrency whose KV cache fits: shaded, crosses, no schedule
            ax.axvspan(max(held) * 2 ** 0.5 if held else cs[0] / 2 ** 0.5, cs[-1] * 2 ** 0.5, color="C3", alpha=0.08,
                       label="KV cache does not fit")
        best = out["schedules"].get(name, {}).get("best_k", {})
        by = {(r["ttt_steps"], r["concurrency"]): r["speedup"] for r in rows}
        sc = [c for c in cs if c in best]
        ax.plot(sc, [by[(best[c], c)] if best[c] else 1.0 for c in sc], "k*", ms=9, label="schedule")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs], fontsize=7)
        ax.set_xlabel("concurrency (requests decoding at once)")
        ax.set_title(f"{name} (model)", fontsize=9)
    axes[0][0].set_ylabel("speedup over the verifier alone")
    drawn = [ax for ax in axes[0] if ax.get_legend_handles_labels()[0]]
    if drawn:  # the last panel may be a machine that holds nothing
        drawn[-1].legend(fontsize=7)
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


def decode_table(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Absolute decode speed, modelled against published measurements (context: prompt + half the answer, which
    tells one source's workloads apart); the point the tensor-parallel term was fitted to is marked, the others are
    out of sample. model_over_measured is tokens/s: above 1, the model is faster than measured."""
    return pl.DataFrame(rows).select(
        "model", "setup", "batch", pl.col("context").alias("context tokens"),
        pl.when(pl.col("fitted")).then(pl.lit("fit")).otherwise(pl.lit("check")).alias("role"),
        "published_tpot_ms", "model_tpot_ms", "published_tokens_per_s", "model_tokens_per_s",
        pl.col("model_over_published").alias("model_over_measured"))


def comparison_table(rows: list[dict[str, Any]], measured: str) -> pl.DataFrame | str:
    if not rows:
        return "No measured grid in this run (evaluate.concurrency_sweep measures one on this machine)."
    df = pl.DataFrame(rows)
    return df.with_columns((pl.col("model_speedup") / pl.col(measured)).alias("model_over_measured"))
