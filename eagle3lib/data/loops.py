"""Answers that loop: the same n-gram repeated to the end of the answer (small models do it under greedy and
low-temperature decoding, until max_tokens cuts them).

A drafter predicts a loop almost perfectly once it has seen one period, so the acceptance length measured on
looping answers is not what users of the verifier get on the answers they read; the generate and evaluate stages
count looping answers and report tau on the others separately.

An answer loops when its tail is periodic with some period p <= `max_period` (ids[i] == ids[i - p] for every i in the
tail) and that tail spans at least `min_repeats` periods and `min_tokens` tokens. Trailing end-of-turn ids are not
part of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

MAX_PERIOD = 64  # a repeated sentence or list item; longer periods are rarely exact repeats
MIN_REPEATS = 3  # two copies can be a quotation or a parallel sentence; three to the end is a loop
MIN_TOKENS = 24  # a short tail of repeated punctuation or a table rule is not a loop


def loop_tail(ids: Sequence[int], stop_ids: Iterable[int] = (), max_period: int = MAX_PERIOD,
              min_repeats: int = MIN_REPEATS, min_tokens: int = MIN_TOKENS) -> tuple[int, int] | None:
    """(index where the periodic tail begins, its period), the earliest start over all periods; None when the answer
    does not loop."""
    a = np.asarray(ids, dtype=np.int64)
    stops = set(stop_ids)
    n = len(a)
    while n and int(a[n - 1]) in stops:
        n -= 1
    a = a[:n]
    best: tuple[int, int] | None = None
    for p in range(1, min(max_period, n // min_repeats) + 1):
        same = a[p:] == a[:-p]  # same[j]: a[j + p] == a[j]
        breaks = np.flatnonzero(~same)
        start = int(breaks[-1]) + 1 if len(breaks) else 0  # the tail a[start:] equals itself shifted by p
        span = n - start
        if span >= max(min_repeats * p, min_tokens) and (best is None or start < best[0]):
            best = (start, p)
    return best


def repetition_detection() -> dict[str, int]:
    """vLLM's `repetition_detection` request field (>= 0.17) set to stop an answer once it loops by the definition
    above, one period later than it first qualifies. vLLM stops when the answer's last `min_count` x L tokens repeat
    one L-token pattern, for some L in [min_pattern_size, max_pattern_size]. A loop of period p is also periodic in
    every multiple of p, so L from 8 catches the short periods too, over >= 32 tokens (MIN_TOKENS is 24). The extra
    period (4 where the definition asks 3) keeps a passage said three times (a chorus, a quotation) from being cut;
    the answer then holds >= 4 periods, of which extract keeps 2 (`trim_loop`) as it does for a loop that ran to
    max_tokens."""
    return {"min_pattern_size": MIN_TOKENS // MIN_REPEATS, "max_pattern_size": MAX_PERIOD,
            "min_count": MIN_REPEATS + 1}


def loop_start(ids: Sequence[int], stop_ids: Iterable[int] = ()) -> int | None:
    tail = loop_tail(ids, stop_ids)
    return None if tail is None else tail[0]


def loops(ids: Sequence[int], stop_ids: Iterable[int] = ()) -> bool:
    return loop_tail(ids, stop_ids) is not None


def trim_loop(ids: Sequence[int], stop_ids: Iterable[int] = (), periods: int = 2) -> list[int]:
    """The answer up to `periods` periods of its loop (the start of the repetition is the verifier's own, and what a
    drafter must learn to follow; the dozens of identical periods after it teach nothing more); unchanged when it does
    not loop."""
    tail = loop_tail(ids, stop_ids)
    return list(ids) if tail is None else list(ids[: tail[0] + periods * tail[1]])
