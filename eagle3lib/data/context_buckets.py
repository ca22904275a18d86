"""Acceptance per context-length bucket (evaluate.context_buckets): how tau holds up as the context grows.

A drafter is trained on rows of some length and served on whatever the users send; long reasoning traces and long
documents are where its attention has to reach furthest back. The buckets are half-open ranges of context length
[edge_i, edge_{i+1}), labelled "<4K", "4K-8K", ">=16K" for edges [4096, 8192, 16384].

The two measurements bucket differently, because of what each can see:
  library  per verification round: the context is the prompt plus every token generated before the round (what the
           drafter attends over when it drafts), from the round-by-round acceptances of eagle3lib.model.speculative.
  vLLM     per request, by prompt length: its spec-decode counters are totals, so each bucket's prompts are sent as a
           group and the counters' deltas are that group's (eagle3lib/vllm/measure.py). With answers of a few hundred
           tokens and buckets thousands wide, a request's rounds nearly all fall in its prompt's bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """The buckets' labels in order: "<e0", "e0-e1", ..., ">=e_last"."""
    e = list(edges)
    return [f"<{_k(e[0])}"] + [f"{_k(a)}-{_k(b)}" for a, b in zip(e, e[1:], strict=False)] + [f">={_k(e[-1])}"]


def bucket_key(label: str) -> str:
    """A label as a manifest figure's suffix: "<4K" -> "ctx_lt4K", "4K-8K" -> "ctx_4K_8K", ">=16K" -> "ctx_ge16K"."""
    return "ctx_" + label.replace(">=", "ge").replace("<", "lt").replace("-", "_")


def bucket_of(n_tokens: int, edges: Sequence[int]) -> str:
    """The label of the bucket holding a context of n_tokens."""
    labels = bucket_labels(edges)
    for i, edge in enumerate(edges):
        if n_tokens < edge:
            return labels[i]
    return labels[-1]


def round_contexts(prompt_tokens: int, accepted_per_round: Sequence[int]) -> list[int]:
    """Context length at the start of each round: the prefill emitted one token, and every round emits accepted + 1."""
    out, n = [], prompt_tokens + 1
    for a in accepted_per_round:
        out.append(n)
        n += a + 1
    return out


def library_buckets(records: Sequence[dict[str, Any]], mode: str, edges: Sequence[int], k: int) -> dict[str, Any]:
    """Rounds, accepted drafts, tau and acceptance per position per bucket, pooled over prompts (as summarize_runs
    pools): from each record's prompt length and its `mode` decode's accepted_per_round. Empty buckets are left out."""
    acc: dict[str, list[int]] = {}
    for r in records:
        per_round = r[mode].get("accepted_per_round") or []
        for ctx, a in zip(round_contexts(r["prompt_tokens"], per_round), per_round, strict=True):
            acc.setdefault(bucket_of(ctx, edges), []).append(a)
    out = {}
    for label in bucket_labels(edges):
        rounds = acc.get(label)
        if not rounds:
            continue
        per_pos = [sum(a > i for a in rounds) for i in range(k)]
        out[label] = {"rounds": len(rounds), "accepted": sum(rounds), "tau": 1 + sum(rounds) / len(rounds),
                      "accept_rate_pos": [c / len(rounds) for c in per_pos]}
    return out
