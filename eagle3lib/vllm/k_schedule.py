"""vLLM's K schedule per batch size (`speculative_config.num_speculative_tokens_per_batch_size`, vLLM 0.32): a list
of inclusive (first batch size, last batch size, K) ranges, looked up by the number of requests scheduled in a step
(vllm/v1/spec_decode/dynamic/utils.py); eagle3lib.config.evaluate.check_schedule states its rules."""

from __future__ import annotations

from typing import Any


def schedule_ranges(best_k: dict[int, int]) -> list[list[int]]:
    """The best K at each measured (or modelled) concurrency as vLLM's ranges: each point c covers the batch sizes
    above the previous point up to c (the first from 1; vLLM carries the last K on past the last point); neighbours
    with the same K merge."""
    ranges: list[list[int]] = []
    lo = 1
    for c in sorted(best_k):
        if ranges and ranges[-1][2] == best_k[c]:
            ranges[-1][1] = c
        else:
            ranges.append([lo, c, best_k[c]])
        lo = c + 1
    return ranges


def fastest_k(rows: list[dict[str, Any]]) -> dict[int, int]:
    """The K (0 = no drafting) with the highest tokens/s at each concurrency, from rows of a measured grid or of the
    decode model; rows without a figure are skipped, and a tie (within 1e-9) keeps the K seen first."""
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        c, tps = r["concurrency"], r["tokens_per_s"]
        if tps is not None and (c not in best or tps > best[c]["tokens_per_s"] * (1 + 1e-9)):
            best[c] = r
    return {c: r["ttt_steps"] for c, r in sorted(best.items())}
