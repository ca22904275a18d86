# .venv/bin/python -m pytest -q tests/test_per_prompt.py
"""Acceptance per prompt (eagle3lib/evaluation/per_prompt.py): tau pooled by rounds, its bootstrap interval over
prompts (covering the truth at about its level on simulated prompts), the paired ratio of two drafters, and tau apart
for answers that loop."""

from __future__ import annotations

import random

from eagle3lib.evaluation.per_prompt import loop_split, pooled, ratio_interval, tau_interval


def _rows(taus: list[float], rounds: int = 50, k: int = 3) -> list[dict]:
    out = []
    for i, t in enumerate(taus):
        acc = round((t - 1) * rounds)
        out.append({"id": f"p{i}", "rounds": rounds, "accepted": acc,
                    "accepted_per_pos": [min(rounds, acc), max(0, acc - rounds), 0][:k]})
    return out


def test_pooled_weighs_prompts_by_rounds():
    rows = [{"id": "a", "rounds": 10, "accepted": 20, "accepted_per_pos": [8, 7, 5]},
            {"id": "b", "rounds": 30, "accepted": 0, "accepted_per_pos": [0, 0, 0]}]
    p = pooled(rows)
    assert p["tau"] == 1 + 20 / 40 and p["accept_rate_pos"] == [8 / 40, 7 / 40, 5 / 40] and p["prompts"] == 2
    assert pooled([])["tau"] is None


def test_interval_covers_the_true_tau_at_about_its_level():
    """Prompts drawn from a population whose pooled tau is known: the 90% interval holds it in ~90% of draws."""
    rng = random.Random(1)
    population = [1 + 2.5 * rng.random() for _ in range(20_000)]
    truth = sum(population) / len(population)  # equal rounds per prompt: the pooled tau is the mean
    hits = 0
    for trial in range(60):
        lo, hi = tau_interval(_rows(rng.sample(population, 40)), level=0.9, samples=400, seed=trial)
        hits += lo <= truth <= hi
    assert 0.78 <= hits / 60 <= 0.99, hits


def test_paired_ratio_is_narrower_than_the_prompts_spread():
    """Two drafters on the same prompts, one 10% better on each: the paired interval is tight around 1.1 although the
    prompts' own taus spread from 1 to 3.5."""
    rng = random.Random(2)
    base = [1 + 2.5 * rng.random() for _ in range(40)]
    a, b = _rows([1 + 1.1 * (t - 1) for t in base]), _rows(base)
    lo, hi = ratio_interval(a, b, samples=400)
    assert 1.0 < lo < hi < 1.2 and hi - lo < 0.15


def test_loop_split():
    rows = _rows([3.8, 1.5, 1.7])
    outputs = {"p0": list(range(10)) + [5, 6] * 20, "p1": list(range(40)), "p2": None}
    s = loop_split(rows, outputs)
    assert s["looping_share"] == 1 / 3 and s["looping"]["tau"] == 3.8 and s["not_looping"]["prompts"] == 2
    assert s["not_looping"]["tau"] == 1.6 and s["looping"]["interval"] is None  # one prompt: no interval
