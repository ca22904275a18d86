"""Data-scaling points scored on samples that did not choose them, and their uncertainty by resampling samples.

A point is one training run (one fraction of the data) at its best validation. Chosen and scored on the same
validation split, that best is the maximum of many noisy estimates: biased upward, and more so for the small
fractions, which validate more often under `schedule: steps`; the curve flattens and understates the data a target
needs. Here the validation samples are split in two halves by a hash of their id (the same halves for every point);
the validation chosen on half A is scored on half B and the one chosen on B on A, and the point is the mean of the
two scores (cross-fitting): no sample scores a choice it made.

Uncertainty: the answer positions of one sample are correlated (a hard answer rejects at many positions), so a
binomial error over positions understates the spread. Each resampling draw weights the validation samples by a
multinomial draw, the same weights for every point (they share one validation split, so a hard sample lowers all of
them together), and repeats the choice and the score; the band of the curve comes from refitting every draw's points
(eagle3lib/analysis/scaling.py). Counts per sample: train/val_samples.jsonl (eagle3lib/training/validate.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3lib.data.val_counts import SAMPLES_FILE, read_sample_counts


@dataclass
class SampleCounts:
    steps: list[int]  # the validations, in order
    ids: list[str]  # the validation samples (the same at every step)
    n: np.ndarray  # [steps, samples, K] positions counted at TTT step k
    full: np.ndarray  # [steps, samples, K] of those, drafted correctly at steps 0..k (fully accepted)

    def tau(self, w: np.ndarray) -> np.ndarray:
        """tau estimate at every validation with sample weights `w` [samples]: 1 + sum_k full_k / n_k (weighted)."""
        num, den = np.einsum("snk,n->sk", self.full, w), np.einsum("snk,n->sk", self.n, w)
        return 1.0 + np.where(den > 0, num / np.maximum(den, 1e-300), 0.0).sum(-1)


def load_counts(train_dir: Path, steps: list[int]) -> SampleCounts | None:
    """The per-sample counts of a train run's validations at `steps` (those its metrics.jsonl records); None when it
    kept none (trained before they were kept) or one of them has no counts."""
    got = read_sample_counts(Path(train_dir) / SAMPLES_FILE, set(steps))
    if not steps or any(s not in got for s in steps):
        return None
    ids = got[steps[0]]["ids"]
    if any(got[s]["ids"] != ids for s in steps):
        return None
    return SampleCounts(steps, ids, np.array([got[s]["n"] for s in steps], dtype=float),
                        np.array([got[s]["full"] for s in steps], dtype=float))


def half_a(ids: list[str]) -> np.ndarray:
    """The choosing half of each sample, fixed by its id (the same split for every point and every run)."""
    return np.array([hashlib.sha256(i.encode()).digest()[0] & 1 == 0 for i in ids])


def cross_fit(c: SampleCounts, w: np.ndarray) -> tuple[float, int, int]:
    """(score, step chosen on A, step chosen on B): the checkpoint chosen on one half scored on the other, averaged."""
    a = half_a(c.ids)
    ta, tb = c.tau(w * a), c.tau(w * ~a)
    ia, ib = int(np.argmax(ta)), int(np.argmax(tb))
    return 0.5 * (float(tb[ia]) + float(ta[ib])), c.steps[ia], c.steps[ib]


def same_split(c: SampleCounts, w: np.ndarray) -> float:
    """The biased score, for comparison: the best validation chosen and scored on all of it."""
    return float(c.tau(w).max())


@dataclass
class ScoredPoints:
    tau: list[float]  # each point's cross-fitted score
    chosen: list[tuple[int, int]]  # each point's validations chosen on half A and on half B
    draws: np.ndarray  # [draws, points] the scores under resampled sample weights
    samples: int  # validation samples the resampling draws from (the union over points)

    @property
    def se(self) -> list[float]:
        return np.std(self.draws, axis=0, ddof=1).tolist()


def score_points(counts: list[SampleCounts], draws: int, seed: int) -> ScoredPoints:
    """Cross-fitted scores of every point, and `draws` resamplings with weights shared across points by sample id."""
    universe = sorted({i for c in counts for i in c.ids})
    slot = {i: j for j, i in enumerate(universe)}
    cols = [np.array([slot[i] for i in c.ids]) for c in counts]
    base = [cross_fit(c, np.ones(len(c.ids))) for c in counts]
    rng = np.random.default_rng(seed)
    out = np.empty((draws, len(counts)))
    for d in range(draws):
        w = rng.multinomial(len(universe), np.full(len(universe), 1.0 / len(universe))).astype(float)
        out[d] = [cross_fit(c, w[col])[0] for c, col in zip(counts, cols, strict=True)]
    return ScoredPoints([b[0] for b in base], [(b[1], b[2]) for b in base], out, len(universe))
