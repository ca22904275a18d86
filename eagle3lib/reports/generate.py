"""What the generate stage's notebook shows: lengths of reasoning and content, sample answers, what went wrong."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import polars as pl

from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.records import iter_generated


def length_table(gen_dir: str | Path, tokenizer=None, statuses: Iterable[str] | None = None, limit: int | None = None):
    """polars DataFrame, one row per prompt: status, category, token counts of the prompt, the reasoning and the content.

    With a tokenizer (the verifier's), reasoning and content are counted exactly; without one, completion_tokens is
    split by their share of characters (`*_est` columns).
    """
    rows = []
    for conv in iter_generated(gen_dir, statuses):
        last = conv.messages[-1] if conv.messages and conv.messages[-1].get("role") == "assistant" else {}
        rows.append({"id": conv.id, "category": conv.category, "status": conv.extra["status"],
                     "finish_reason": conv.extra["finish_reason"], "prompt_tokens": conv.extra["prompt_tokens"],
                     "completion_tokens": conv.extra["completion_tokens"],
                     "reasoning": last.get("reasoning_content") or "", "content": last.get("content") or ""})
        if limit is not None and len(rows) >= limit:
            break
    df = pl.DataFrame(rows, schema={"id": pl.String, "category": pl.String, "status": pl.String,
                                    "finish_reason": pl.String, "prompt_tokens": pl.Int64, "completion_tokens": pl.Int64,
                                    "reasoning": pl.String, "content": pl.String})
    if tokenizer is not None:
        def count(texts: list[str]) -> list[int]:
            return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []

        df = df.with_columns(pl.Series("reasoning_tokens", count(df["reasoning"].to_list()), dtype=pl.Int64),
                             pl.Series("content_tokens", count(df["content"].to_list()), dtype=pl.Int64))
    else:
        chars = (df["reasoning"].str.len_chars() + df["content"].str.len_chars()).cast(pl.Float64)
        share = (df["reasoning"].str.len_chars().cast(pl.Float64) / chars).fill_nan(0.0)
        df = df.with_columns((share * df["completion_tokens"]).round().cast(pl.Int64).alias("reasoning_tokens_est"),
                             ((1 - share) * df["completion_tokens"]).round().cast(pl.Int64).alias("content_tokens_est"))
    return df.drop("reasoning", "content")


def report_lengths(gen_dir: str | Path, verifier_cfg: VerifierConfig, limit: int = 20_000) -> tuple[pl.DataFrame, str]:
    """(length table with reasoning_tokens / content_tokens, how they were counted): with the verifier's tokenizer, or
    split by characters when it cannot be loaded here (a remote verifier)."""
    from eagle3lib.model.verifier import load_tokenizer, resolve_model

    try:
        tokenizer = load_tokenizer(resolve_model(verifier_cfg.model), verifier_cfg.trust_remote_code)
        how = "counted with the verifier's tokenizer"
    except ValueError as e:
        tokenizer, how = None, f"estimated from characters (tokenizer not available: {e})"
    lengths = length_table(gen_dir, tokenizer, statuses=None, limit=limit)
    if tokenizer is None:
        lengths = lengths.rename({"reasoning_tokens_est": "reasoning_tokens", "content_tokens_est": "content_tokens"})
    return lengths, how


def length_summary(lengths: pl.DataFrame) -> pl.DataFrame:
    """Per status: responses, mean reasoning and content tokens, the longest completion."""
    return lengths.group_by("status").agg(
        pl.len().alias("responses"), pl.col("reasoning_tokens").mean().round(1).alias("mean_reasoning_tokens"),
        pl.col("content_tokens").mean().round(1).alias("mean_content_tokens"),
        pl.col("completion_tokens").max().alias("max_completion_tokens")).sort("status")


def length_histograms(lengths: pl.DataFrame):
    """Reasoning, content and completion tokens per response, stacked by status on shared bins (log counts)."""
    answered = lengths.filter(pl.col("status") != "failed")
    statuses = sorted(set(answered["status"]))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for ax, col in zip(axes, ("reasoning_tokens", "content_tokens", "completion_tokens"), strict=True):
        if answered.height:
            edges = np.histogram_bin_edges(answered[col].to_numpy(), bins=40)  # shared bins: stacked bars add up
            ax.hist([answered.filter(pl.col("status") == s)[col].to_numpy() for s in statuses], bins=edges,
                    stacked=True, label=statuses, log=True)
        ax.set(xlabel=col.replace("_", " "), ylabel="responses (log)")
    axes[0].legend()
    fig.suptitle("response lengths, by status")
    fig.tight_layout()
    return fig


def reasoning_vs_content(lengths: pl.DataFrame):
    """One point per answered response, colored by category."""
    answered = lengths.filter(pl.col("status") != "failed")
    fig, ax = plt.subplots(figsize=(5, 4))
    for (cat,), part in sorted(answered.group_by("category"), key=lambda kv: str(kv[0][0])):
        ax.scatter(part["reasoning_tokens"].to_list(), part["content_tokens"].to_list(), s=6, alpha=0.5, label=str(cat))
    ax.set(xlabel="reasoning tokens", ylabel="content tokens", title="reasoning vs content per response")
    if answered.height:
        ax.legend()
    return fig


def answers_markdown(gen_dir: str | Path, n: int = 4) -> str:
    """The first n records: the prompt, reasoning and content apart, length, finish reason and any error."""
    out = []
    for conv in islice(iter_generated(gen_dir, statuses=None), n):
        answer = conv.messages[-1] if conv.messages and conv.messages[-1]["role"] == "assistant" else {}
        prompt = conv.messages[-2 if answer else -1]["content"]
        x = conv.extra
        out.append(f"**[{conv.category}, {x['status']}] {prompt}**  \n"
                   f"*reasoning:* {(answer.get('reasoning_content') or '').strip() or '(none)'}  \n"
                   f"*content:* {(answer.get('content') or '').strip() or '(none)'}  \n"
                   f"<small>{x['completion_tokens']} tokens, finish_reason={x['finish_reason']}"
                   f"{', error: ' + x['error'] if x['error'] else ''}</small>")
    return "\n\n".join(out) or "(no records yet)"


def problems_table(gen_dir: str | Path, n: int = 20) -> pl.DataFrame:
    """The first n records that are not training data (failed, empty, truncated), with why."""
    problems = list(islice(iter_generated(gen_dir, statuses=("failed", "empty", "truncated")), n))
    rows: list[dict[str, Any]] = [{"id": c.id, "status": c.extra["status"], "finish_reason": c.extra["finish_reason"],
                                   "attempts": c.extra["attempts"], "error": c.extra["error"]} for c in problems]
    return pl.DataFrame(rows, schema={"id": pl.String, "status": pl.String, "finish_reason": pl.String,
                                      "attempts": pl.Int64, "error": pl.String})
