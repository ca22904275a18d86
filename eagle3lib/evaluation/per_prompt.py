"""Acceptance per prompt: its interval over prompts, and apart for answers that loop.

tau pooled over prompts = 1 + (sum of accepted drafts) / (sum of rounds): a long answer weighs by its rounds, as in
vLLM's counters. Its interval is a percentile bootstrap over prompts (prompts are the unit that varies: resampling
rounds would treat a prompt's correlated rounds as independent and give intervals far too narrow).

Answers that loop (eagle3lib/data/loops.py) accept almost every draft once one period has been seen: tau on them is
not what users get on the answers they read, so it is reported apart from tau on the rest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from eagle3lib.data.loops import loops

BOOTSTRAP_SAMPLES = 2000


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tau and acceptance per position of rows with `rounds`, `accepted` and `accepted_per_pos` (a prompt each)."""
    rounds = sum(int(r["rounds"]) for r in rows)
    accepted = sum(int(r["accepted"]) for r in rows)
    k = max((len(r.get("accepted_per_pos") or []) for r in rows), default=0)
    per_pos = [sum((r.get("accepted_per_pos") or [0] * k)[i] for r in rows) for i in range(k)]
    return {"prompts": len(rows), "rounds": rounds, "accepted": accepted,
            "tau": 1.0 + accepted / rounds if rounds else None,
            "accept_rate_pos": [x / rounds if rounds else None for x in per_pos]}


def tau_interval(rows: Sequence[dict[str, Any]], level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the pooled tau, prompts resampled with replacement."""
    rows = [r for r in rows if int(r["rounds"]) > 0]
    if len(rows) < 2:
        return None
    rng = random.Random(seed)
    acc = [int(r["accepted"]) for r in rows]
    rnd = [int(r["rounds"]) for r in rows]
    n = len(rows)
    taus = []
    for _ in range(samples):
        idx = [rng.randrange(n) for _ in range(n)]
        taus.append(1.0 + sum(acc[i] for i in idx) / sum(rnd[i] for i in idx))
    taus.sort()
    lo = taus[int((1 - level) / 2 * samples)]
    hi = taus[min(samples - 1, int((1 + level) / 2 * samples))]
    return lo, hi


def ratio_interval(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], level: float = 0.95,
                   samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """Interval of tau(a) / tau(b) for two drafters measured on the same prompts (rows matched by `id`): the same
    prompts resampled for both, so a prompt that is easy for both does not widen it."""
    return paired_interval(a, b, lambda ta, tb: ta / tb, level, samples, seed)


def difference_interval(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], level: float = 0.95,
                        samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """Interval of tau(a) - tau(b) on the same prompts, paired as ratio_interval: a gain in accepted tokens per round."""
    return paired_interval(a, b, lambda ta, tb: ta - tb, level, samples, seed)


def paired_interval(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], op: Callable[[float, float], float],
                    level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap of op(tau(a), tau(b)), the matched prompts resampled together."""
    bb = {r["id"]: r for r in b}
    pairs = [(r, bb[r["id"]]) for r in a if r["id"] in bb]
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    n = len(pairs)
    values = []
    for _ in range(samples):
        idx = [rng.randrange(n) for _ in range(n)]
        ta, tb = pooled([pairs[i][0] for i in idx])["tau"], pooled([pairs[i][1] for i in idx])["tau"]
        if ta is not None and tb:
            values.append(op(ta, tb))
    if not values:
        return None
    values.sort()
    return values[int((1 - level) / 2 * len(values))], values[min(len(values) - 1, int((1 + level) / 2 * len(values)))]


def loop_split(rows: Sequence[dict[str, Any]], outputs: dict[str, Sequence[int] | None],
               stop_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Rows (with `id`) pooled apart by whether the prompt's answer (`outputs[id]`, token ids) loops."""
    stops = list(stop_ids)
    looping = {pid for pid, ids in outputs.items() if ids and loops(ids, stops)}
    loop_rows = [r for r in rows if r["id"] in looping]
    rest = [r for r in rows if r["id"] not in looping]
    return {"looping_share": len(loop_rows) / len(rows) if rows else None,
            "looping": {**pooled(loop_rows), "interval": tau_interval(loop_rows)},
            "not_looping": {**pooled(rest), "interval": tau_interval(rest)}}


def add_spread(block: dict[str, Any], modes: Sequence[str], rows: dict[str, list[dict[str, Any]]],
               outputs: dict[str, dict[str, Sequence[int] | None]], stop_ids: Iterable[int]) -> None:
    """Into a measurement's results (the library's or vLLM's, one entry per mode): tau's interval over prompts
    (`tau_interval`) and the looping / not looping split (`loops`)."""
    for m in modes:
        if m in block and rows.get(m):
            block[m]["tau_interval"] = tau_interval(rows[m])
            block[m]["loops"] = loop_split(rows[m], outputs.get(m) or {}, stop_ids)


def lib_rows(lib: dict[str, Any], modes: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The library's records as per-prompt counter rows, per mode."""
    return {m: [{"id": r["id"], "rounds": r[m]["rounds"], "accepted": r[m]["accepted"],
                 "accepted_per_pos": r[m]["accepted_per_pos"]} for r in lib["records"]] for m in modes}


def lib_outputs(lib: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    modes = [m for m in ("greedy", "sampled") if lib["records"] and m in lib["records"][0]]
    return {m: {r["id"]: r[m]["tokens"] for r in lib["records"]} for m in modes}
