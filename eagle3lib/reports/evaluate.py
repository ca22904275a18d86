"""Tables and the plot of the evaluate stage, from its results.json (eagle3lib.stages.evaluate): estimate vs measurements."""

from __future__ import annotations

import statistics
from typing import Any

import matplotlib.pyplot as plt
import polars as pl

from eagle3lib.evaluation.results import METHOD_LABEL, METHODS, comparison_rows, gap_sentence

SHORT = {"train_est": "estimate\n(train)", "val_est": "estimate\n(val)", "same_dist_est": "estimate\n(vLLM answers)",
         "lib_greedy": "library\ngreedy", "lib_sampled": "library\nsampled", "vllm_greedy": "vLLM\ngreedy",
         "vllm_sampled": "vLLM\nsampled"}
COLORS = {"train_est": "#9e9e9e", "val_est": "#616161", "same_dist_est": "#424242", "lib_greedy": "#1f77b4",
          "lib_sampled": "#aec7e8", "vllm_greedy": "#d62728", "vllm_sampled": "#ff9896"}


def comparison_table(results: dict[str, Any]) -> pl.DataFrame:
    """Method | tau | accept_rate_pos_1..K | gap to vLLM greedy: the estimate and both measurements side by side."""
    rows = comparison_rows(results)
    cols = ["label", "tau", *[f"accept_rate_pos_{i + 1}" for i in range(results["ttt_steps"])], "gap_vs_vllm_greedy"]
    return pl.DataFrame([{c: r.get(c) for c in cols} for r in rows], schema={c: (pl.Utf8 if c == "label" else pl.Float64)
                                                                              for c in cols}, orient="row")


def category_table(results: dict[str, Any]) -> pl.DataFrame:
    """tau per prompt category and method (measurements only: the training estimate has no categories)."""
    cats = sorted({c for side in ("lib", "vllm") for mode in ("greedy", "sampled")
                   for c in (((results.get(side) or {}).get(mode) or {}).get("categories") or {})})
    rows = []
    for cat in cats:
        row: dict[str, Any] = {"category": cat, "prompts": results["prompts"]["per_category"].get(cat)}
        for side in ("lib", "vllm"):
            for mode in ("greedy", "sampled"):
                c = ((((results.get(side) or {}).get(mode) or {}).get("categories") or {}).get(cat)) or {}
                row[f"tau_{side}_{mode}"] = c.get("tau")
        rows.append(row)
    schema = {"category": pl.Utf8, "prompts": pl.Int64,
              **{f"tau_{s}_{m}": pl.Float64 for s in ("lib", "vllm") for m in ("greedy", "sampled")}}
    return pl.DataFrame(rows, schema=schema, orient="row")


def spread_table(results: dict[str, Any]) -> pl.DataFrame:
    """Per measurement: tau with its 95% interval over prompts (bootstrap), the share of answers that loop (the same
    n-gram repeated to the end) and tau on the answers that do not and on those that do: the library always, vLLM
    with evaluate.per_prompt."""
    rows = []
    for side, label in (("lib", "library"), ("vllm", "vLLM")):
        for mode in ("greedy", "sampled"):
            m = (results.get(side) or {}).get(mode) or {}
            if not m.get("loops"):
                continue
            lo, hi = m.get("tau_interval") or (None, None)
            loops = m["loops"]
            rows.append({"measurement": f"{label}, {mode}", "tau": m.get("tau"), "tau_95_lo": lo, "tau_95_hi": hi,
                         "looping_share": loops["looping_share"], "tau_not_looping": loops["not_looping"]["tau"],
                         "prompts_not_looping": loops["not_looping"]["prompts"], "tau_looping": loops["looping"]["tau"]})
    schema = {"measurement": pl.Utf8, "tau": pl.Float64, "tau_95_lo": pl.Float64, "tau_95_hi": pl.Float64,
              "looping_share": pl.Float64, "tau_not_looping": pl.Float64, "prompts_not_looping": pl.Int64,
              "tau_looping": pl.Float64}
    return pl.DataFrame(rows, schema=schema, orient="row")


def context_table(results: dict[str, Any]) -> pl.DataFrame:
    """tau per context-length bucket (evaluate.context_buckets) and method, with the library's rounds in each: the
    library buckets each round by its context, vLLM each request by its prompt (eagle3lib/data/context_buckets.py)."""
    cols = [(s, m) for s in ("lib", "vllm") for m in ("greedy", "sampled")]
    blocks = {c: (((results.get(c[0]) or {}).get(c[1]) or {}).get("context_buckets") or {}) for c in cols}
    labels = list(dict.fromkeys(label for b in blocks.values() for label in b))
    rows = []
    for label in labels:
        row: dict[str, Any] = {"context": label}
        for s, m in cols:
            b = blocks[(s, m)].get(label) or {}
            row[f"tau_{s}_{m}"] = b.get("tau")
            if s == "lib" and m == "greedy":
                row["rounds_lib_greedy"] = b.get("rounds")
            if s == "vllm" and m == "greedy":
                row["prompts_vllm"] = b.get("prompts")
        rows.append(row)
    schema = {"context": pl.Utf8, "tau_lib_greedy": pl.Float64, "rounds_lib_greedy": pl.Int64, "tau_lib_sampled": pl.Float64,
              "tau_vllm_greedy": pl.Float64, "prompts_vllm": pl.Int64, "tau_vllm_sampled": pl.Float64}
    return pl.DataFrame([{c: r.get(c) for c in schema} for r in rows], schema=schema, orient="row")


def speed_table(results: dict[str, Any]) -> pl.DataFrame:
    """Library: plain vs speculative decoding wall clock; vLLM: output tokens/s with and without the drafter."""
    rows = []
    lib = results.get("lib")
    if lib:
        mode = lib["baseline_mode"]
        rows.append({"where": f"library ({lib['device']}, {lib['dtype']}, batch 1)", "mode": mode,
                     "tokens_per_s_base": lib["plain"]["tokens_per_s"], "tokens_per_s_spec": lib["spec_tokens_per_s"],
                     "speedup": lib["speedup"]})
    v = results.get("vllm")
    if v:
        for mode in ("greedy", "sampled"):
            if mode in v and mode in v.get("base", {}):
                s, b = v[mode]["tokens_per_s"], v["base"][mode]["tokens_per_s"]
                rows.append({"where": "vLLM server", "mode": mode, "tokens_per_s_base": b, "tokens_per_s_spec": s,
                             "speedup": s / b if s and b else None})
    speed = results.get("vllm_speed")
    if speed and speed.get("speedup") is not None:  # evaluate.speed_repeats: the two servers interleaved
        reps = speed["repeats"]
        lo, hi = speed["speedup_range"]
        rows.append({"where": f"vLLM, interleaved x{len(reps)} (median; range {lo:.2f}-{hi:.2f})", "mode": "greedy",
                     "tokens_per_s_base": statistics.median(r["base_tokens_per_s"] for r in reps),
                     "tokens_per_s_spec": statistics.median(r["spec_tokens_per_s"] for r in reps),
                     "speedup": speed["speedup"]})
    schema = {"where": pl.Utf8, "mode": pl.Utf8, "tokens_per_s_base": pl.Float64, "tokens_per_s_spec": pl.Float64,
              "speedup": pl.Float64}
    return pl.DataFrame(rows, schema=schema, orient="row")


def plot_comparison(results: dict[str, Any]):
    """Left: acceptance rate per draft position (share of rounds whose first i drafts were all accepted) for every
    method. Right: tau per method, the vLLM greedy measurement as the reference line."""
    rows = {r["method"]: r for r in comparison_rows(results)}
    k = results["ttt_steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(1, k + 1))
    for m in METHODS:
        r = rows.get(m)
        if not r:
            continue
        ys = [r.get(f"accept_rate_pos_{i}") for i in xs]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pts:
            ax1.plot(*zip(*pts, strict=True), marker="o", color=COLORS[m], ls="--" if m.endswith("_est") else "-",
                     label=METHOD_LABEL[m])
    ax1.set(xlabel="draft position i", ylabel="acceptance rate (first i drafts accepted)", ylim=(0, 1.02),
            xticks=xs, title="acceptance per position")
    ax1.legend(fontsize=8)
    names = [m for m in METHODS if m in rows and rows[m]["tau"] is not None]
    taus = [rows[m]["tau"] for m in names]
    bars = ax2.bar(range(len(names)), taus, color=[COLORS[m] for m in names])
    for b, t in zip(bars, taus, strict=True):
        ax2.text(b.get_x() + b.get_width() / 2, t + 0.02, f"{t:.2f}", ha="center", va="bottom", fontsize=8)
    ref = rows.get("vllm_greedy", {}).get("tau")
    if ref:
        ax2.axhline(ref, color=COLORS["vllm_greedy"], lw=0.8, ls=":")
    ax2.set_xticks(range(len(names)), [SHORT[m] for m in names], fontsize=8)
    title = f"tau (K={k}, at most {k + 1})"
    est = rows.get("val_est", {}).get("tau")
    if ref and est:
        title += f"; val estimate {est - ref:+.2f} vs vLLM greedy"
    ax2.set(ylabel="acceptance length tau", ylim=(0, k + 1.2), title=title)
    fig.tight_layout()
    return fig


def header_markdown(results: dict[str, Any], figures: dict[str, Any]) -> str:
    """What was measured, and the gap between the training-time estimate and serving, in words."""
    return (f"K = {results['ttt_steps']} draft tokens per round (drafter trained for {results['ttt_steps_trained']}); {results['prompts']['used']} prompts "
            f"({results['prompts']['source']}); checkpoint `{results['checkpoint']}`\n\n{gap_sentence(figures)}")


def per_prompt_table(results: dict[str, Any]) -> pl.DataFrame | str:
    """Library measurement per prompt, the prompts where the drafter is accepted least first."""
    rows = results.get("lib_per_prompt") or []
    if not rows:
        return "library not measured"
    return pl.DataFrame(rows).sort(next(c for c in rows[0] if c.startswith("tau_")))


def warnings_markdown(results: dict[str, Any]) -> str:
    return "\n".join(f"- {w}" for w in results["warnings"]) or "none"


def k_sweep_table(results: dict[str, Any]) -> pl.DataFrame | str:
    """The K sweep, one row per K; a sentence when none was run."""
    sweep = results.get("k_sweep")
    if not sweep:
        return "No K sweep in this run (evaluate.ttt_steps_sweep: [1, 2, 3, 4, 5] measures one)."
    return pl.DataFrame(sweep["rows"])


def k_sweep_markdown(results: dict[str, Any]) -> str:
    sweep = results.get("k_sweep")
    if not sweep:
        return ""
    where = sweep.get("gpu_model")
    model = (f"**modelled on a GPU** ({where}; an estimate, not a measurement: eagle3lib/analysis/decode_time.py, drawn over "
             f"every concurrency and machine by the deployment stage): K = {sweep['k_best_gpu_model']}" if where else
             "no GPU model")
    return (f"Best K **measured here**: {sweep['k_best_here']} (tokens/s over the verifier alone on this machine); "
            f"best K {model}.")


def plot_k_sweep(results: dict[str, Any]):
    """tau and acceptance per position against K; measured speedup here and the modelled GPU speedup."""
    rows = results["k_sweep"]["rows"]
    ks = [r["ttt_steps"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(ks, [r["tau"] for r in rows], "o-", label="tau (vLLM, greedy)")
    for i in range(1, max(ks) + 1):
        pts = [(r["ttt_steps"], r.get(f"accept_rate_pos_{i}")) for r in rows if r.get(f"accept_rate_pos_{i}") is not None]
        if pts:
            a.plot(*zip(*pts, strict=True), ".--", alpha=0.6, label=f"accepted at position {i}")
    a.set_xlabel("K (drafted tokens per step)")
    a.set_xticks(ks)
    a.legend(fontsize=7)
    a.set_title("acceptance")
    b.plot(ks, [r["speedup_here"] for r in rows], "o-", label="measured here")
    if any(r["gpu_speedup_model"] is not None for r in rows):
        b.plot(ks, [r["gpu_speedup_model"] for r in rows], "s--", label="GPU model (estimate)")
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_xlabel("K")
    b.set_xticks(ks)
    b.set_title("speedup over the verifier alone")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def drafters_table(results: dict[str, Any]) -> pl.DataFrame | str:
    """Drafters side by side, this run's first; a sentence when only this run's was measured."""
    rows = results.get("drafters")
    if not rows:
        return "Only this run's drafter was measured (evaluate.drafters lists others to measure beside it)."
    return pl.DataFrame(rows)


def plot_drafters(results: dict[str, Any]):
    """tau per drafter (the training estimate marked where there is one) and acceptance per draft position."""
    rows = results["drafters"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["drafter"] for r in rows]
    a.bar(range(len(rows)), [r["tau"] or 0 for r in rows], color="tab:blue", label="vLLM greedy tau")
    est = [(i, r["tau_estimate"]) for i, r in enumerate(rows) if r.get("tau_estimate") is not None]
    if est:
        a.plot(*zip(*est, strict=True), "k_", ms=18, mew=2, label="training estimate")
    a.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
    a.set_title("acceptance length")
    a.legend(fontsize=7)
    k = max((int(key.rsplit("_", 1)[1]) for r in rows for key in r if key.startswith("accept_rate_pos_")), default=0)
    for r in rows:
        b.plot(range(1, k + 1), [r.get(f"accept_rate_pos_{i}") for i in range(1, k + 1)], "o-", label=r["drafter"])
    b.set_xlabel("draft position")
    b.set_xticks(range(1, k + 1))
    b.set_title("share of rounds accepting position i")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def sampling_table(results: dict[str, Any]) -> pl.DataFrame | str:
    """Sampled tau by draft sample method (evaluate.draft_sample_methods): one row per configuration and temperature,
    tau with its interval over prompts, the gain over greedy drafting with its paired interval, the library's tau."""
    block = results.get("draft_sampling")
    if not block:
        return ("No draft-sampling comparison in this run (evaluate.draft_sample_methods: [greedy, probabilistic] "
                "measures one).")

    def iv(x: Any) -> str | None:
        return f"[{x[0]:.3f}, {x[1]:.3f}]" if x else None

    rows = [{"variant": r["variant"], "temperature": r["temperature"], "tau": r["tau"],
             "tau 95% interval": iv(r["tau_interval"]), "gain over greedy drafting": r["gain_over_greedy"],
             "gain 95% interval": iv(r["gain_interval"]), "tau (library, same drafting)": r["tau_library"],
             **{f"accept_rate_pos_{i}": a for i, a in enumerate(r["accept_rate_pos"] or [], 1)}}
            for r in block["rows"]]
    return pl.DataFrame(rows) if rows else "Every configuration failed to start: see the warnings."
