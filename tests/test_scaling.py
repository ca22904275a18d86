# .venv/bin/python -m pytest -q tests/test_scaling.py
"""The data-scaling fit (eagle3lib/analysis/scaling.py) on synthetic points with a known curve: it recovers the
parameters, its band covers the truth, it inverts a target within the band, says when a target is above the ceiling,
and refuses to draw a curve through fewer than three data sizes. The points (eagle3lib/analysis/scaling_points.py)
on simulated validation splits with a known true tau: cross-fitted scores are unbiased where choosing and scoring on
the same samples is not, the resampled error is the real spread, and the band covers a known curve."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle3lib.analysis.scaling import Curve, explain, fit_scaling, tau_standard_error
from eagle3lib.analysis.scaling_points import SampleCounts, cross_fit, same_split, score_points

TRUE = Curve(c=3.4, t50=3e4, b=1.2)
TOKENS = [2.5e3, 5e3, 1e4, 2e4, 4e4, 8e4, 1.6e5]


def _points(noise: float, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return (TRUE.tau(np.array(TOKENS)) + rng.normal(0, noise, len(TOKENS))).tolist()


def test_recovers_a_known_curve_without_noise():
    fit = fit_scaling(TOKENS, _points(0.0), cap=4.0)
    assert fit.curve is not None
    # tolerances: after the refinement the grid cells are ~0.3% (b) and ~0.8% (T50) wide, c follows exactly
    assert fit.curve.c == pytest.approx(3.4, abs=0.01)
    assert fit.curve.b == pytest.approx(1.2, rel=0.02)
    assert fit.curve.t50 == pytest.approx(3e4, rel=0.02)
    assert fit.curve.tau(6.4e5) == pytest.approx(TRUE.tau(6.4e5), abs=0.005)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_noisy_points_ceiling_within_tolerance_and_band_covers_truth(seed):
    """Noise 0.02 tau (a 200-sample validation split's spread): the ceiling within 0.25 (six points one decade and a
    half wide pin it only so well), the true ceiling inside the refits' 5..95% range, and the 10..90% band at the
    data covering the true curve at most points."""
    fit = fit_scaling(TOKENS, _points(0.02, seed), cap=4.0, sigma_floor=0.02, seed=seed)
    assert abs(fit.curve.c - 3.4) < 0.25
    c_lo, c_hi = np.percentile([d.c for d in fit.draws], [5, 95])
    assert c_lo <= 3.4 <= c_hi
    lo, hi = fit.band(np.array(TOKENS))
    truth = TRUE.tau(np.array(TOKENS))
    assert np.mean((lo - 0.01 <= truth) & (truth <= hi + 0.01)) >= 0.66
    assert np.all(lo <= hi)


def test_target_inverts_within_the_band_and_above_the_ceiling_is_unreachable():
    fit = fit_scaling(TOKENS, _points(0.0), cap=4.0, sigma_floor=0.01)
    target = float(TRUE.tau(2.4e5))  # reached at 1.5x the largest point
    need = fit.needed(target)
    assert need["tokens"] == pytest.approx(2.4e5, rel=0.05)
    assert need["tokens_lo"] <= need["tokens"] <= need["tokens_hi"]
    assert "1.5x the largest point's data" in explain(fit, target, tokens_per_sample=100)
    far = fit.needed(3.6)
    assert math.isinf(far["tokens"]) and far["unreachable_frac"] > 0.9
    assert "above the fitted ceiling" in explain(fit, 3.6, tokens_per_sample=100)


def test_the_ceiling_is_capped_at_k_plus_one():
    """Points still rising steeply would extrapolate past K + 1 tokens per step; the cap holds the curve there."""
    steep = Curve(c=6.0, t50=2e5, b=0.8)
    fit = fit_scaling(TOKENS, steep.tau(np.array(TOKENS)).tolist(), cap=4.0)
    assert fit.curve.c <= 4.0 + 1e-12
    assert all(d.c <= 4.0 + 1e-12 for d in fit.draws)
    assert "do not say where acceptance levels off" in explain(fit, 3.0, 100, cap=4.0)


def test_falling_points_give_a_flat_curve_not_a_falling_one():
    """Acceptance that falls with more data (over-training, a bad mix) is not extrapolated downwards: the curve
    cannot fall, so the best it can do is level at the points' mean."""
    falling = [3.0, 2.95, 2.9, 2.85, 2.8, 2.75, 2.7]
    fit = fit_scaling(TOKENS, falling, cap=4.0)
    t = np.geomspace(1e3, 1e6, 50)
    assert np.all(np.diff(fit.curve.tau(t)) >= -1e-12)
    assert fit.curve.tau(TOKENS[-1]) == pytest.approx(np.mean(falling), abs=0.06)


@pytest.mark.parametrize("tokens", [[37_312 * 4000], [1e4, 1e4, 2e4]])
def test_fewer_than_three_data_sizes_is_no_curve(tokens):
    fit = fit_scaling(tokens, [3.3] * len(tokens), cap=4.0)
    assert fit.curve is None and "cannot be extrapolated" in fit.reason
    assert fit.needed(3.5)["tokens"] is None
    assert explain(fit, 3.5, 100).startswith("No curve")


def test_tau_standard_error_matches_bernoulli_positions_at_one_step():
    """The binomial floor against simulation (K = 1, independent positions: the only case where it is exact)."""
    rng = np.random.default_rng(0)
    p, n = 0.7, 400
    est = rng.binomial(n, p, 4000) / n
    se = tau_standard_error({"full_acc_0": p}, 1, positions=n)
    assert se == pytest.approx(float(np.std(est)), rel=0.05)


# ------------------------------------------------- points from per-sample counts (eagle3lib/analysis/scaling_points.py)
# A simulated validation split: N samples with m_i positions each and a difficulty u_i (logit scale) shared by every
# checkpoint and every point, as one held-out split is; a checkpoint of quality q accepts a draft token at a position
# of sample i with probability sigmoid(q + u_i), and draft step k is fully accepted when steps 0..k all are. The true
# tau of quality q is the expectation over samples, computed once from 200,000 difficulties.
K, N, SPREAD = 3, 60, 1.0
_U = np.random.default_rng(123).normal(0, SPREAD, 200_000)


def true_tau(q: float) -> float:
    a = 1 / (1 + np.exp(-(q + _U)))
    return 1 + sum(float((a ** (k + 1)).mean()) for k in range(K))


def quality_for(tau: float) -> float:
    lo, hi = -8.0, 8.0
    for _ in range(40):
        lo, hi = ((lo + hi) / 2, hi) if true_tau((lo + hi) / 2) < tau else (lo, (lo + hi) / 2)
    return (lo + hi) / 2


def split_of(rng) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(0, SPREAD, N), rng.integers(30, 120, N)


def validations(rng, split, qualities) -> SampleCounts:
    u, m = split
    full = np.zeros((len(qualities), N, K))
    for v, q in enumerate(qualities):
        ok = np.ones((N, m.max()), dtype=bool)
        for k in range(K):
            ok &= rng.random((N, m.max())) < 1 / (1 + np.exp(-(q + u[:, None])))
            full[v, :, k] = [ok[i, : m[i]].sum() for i in range(N)]
    n = np.broadcast_to(m[None, :, None], full.shape).astype(float)
    return SampleCounts(list(range(1, len(qualities) + 1)), [f"s{i}" for i in range(N)], n, full)


def test_choosing_and_scoring_on_the_same_samples_is_biased_and_cross_fitting_is_not():
    """Every checkpoint equally good (true tau known): the best of V validations scored on the samples that chose it
    overshoots, more with more validations (small fractions validate more often under schedule: steps); the
    cross-fitted score does not (within its Monte-Carlo error)."""
    rng = np.random.default_rng(0)
    truth = true_tau(1.0)
    err = {4: [], 16: []}
    for _ in range(200):
        split = split_of(rng)
        for v in err:
            c = validations(rng, split, [1.0] * v)
            err[v].append((same_split(c, np.ones(N)) - truth, cross_fit(c, np.ones(N))[0] - truth))
    e4, e16 = np.array(err[4]), np.array(err[16])
    assert abs(e16[:, 1].mean()) < 0.03 and abs(e4[:, 1].mean()) < 0.03  # its standard error here: ~0.006
    gap4, gap16 = (e4[:, 0] - e4[:, 1]).mean(), (e16[:, 0] - e16[:, 1]).mean()  # paired: standard error ~0.001
    assert gap4 > 0.01 and gap16 > gap4 + 0.005


def test_resampled_error_is_the_spread_of_fresh_validation_splits_and_the_binomial_one_is_not():
    """Answers differ in difficulty, so positions are correlated: the standard error from resampling samples matches
    the spread of the score over fresh validation splits; the per-position binomial one is several times too small."""
    rng = np.random.default_rng(1)
    scores, resampled, binomial = [], [], []
    for i in range(40):
        c = validations(rng, split_of(rng), [1.0] * 6)
        scored = score_points([c], 100, seed=i)
        scores.append(scored.tau[0])
        resampled.append(scored.se[0])
        best = int(np.argmax(c.tau(np.ones(N))))
        rec = {f"full_acc_{k}": c.full[best, :, k].sum() / c.n[best, :, k].sum() for k in range(K)}
        binomial.append(tau_standard_error(rec, K, c.n[best, :, 0].sum()))
    spread = float(np.std(scores, ddof=1))
    assert 0.7 < np.mean(resampled) / spread < 1.4
    assert np.mean(binomial) / spread < 0.3


def test_the_band_covers_a_known_curve_and_the_binomial_floor_band_does_not():
    """Five fractions on one validation split, each with checkpoints rising to the quality the true curve gives its
    data: the resampled band's 10..90% covers the true curve at the points about as often as it should (0.8); the old
    band (best validation, parametric noise at the binomial floor) seldom does."""
    truth = Curve(c=3.2, t50=2e4, b=1.3)
    tokens = np.array([5e3, 1e4, 2e4, 4e4, 8e4])
    quality = [quality_for(t) for t in truth.tau(tokens)]
    rng = np.random.default_rng(2)
    new, old = [], []
    for i in range(20):
        split = split_of(rng)
        cs = [validations(rng, split, [q - 0.6 * np.exp(-v / 2) for v in range(8)]) for q in quality]
        scored = score_points(cs, 150, seed=i)
        lo, hi = fit_scaling(tokens.tolist(), scored.tau, cap=4.0, resampled=scored.draws).band(tokens)
        new.append(np.mean((lo <= truth.tau(tokens)) & (truth.tau(tokens) <= hi)))
        best = [int(np.argmax(c.tau(np.ones(N)))) for c in cs]
        ys = [float(c.tau(np.ones(N))[b]) for c, b in zip(cs, best, strict=True)]
        ses = [tau_standard_error({f"full_acc_{k}": c.full[b, :, k].sum() / c.n[b, :, k].sum() for k in range(K)}, K,
                                  c.n[b, :, 0].sum()) for c, b in zip(cs, best, strict=True)]
        lo, hi = fit_scaling(tokens.tolist(), ys, cap=4.0, sigma_floor=float(np.median(ses)), draws=150,
                             seed=i).band(tokens)
        old.append(np.mean((lo <= truth.tau(tokens)) & (truth.tau(tokens) <= hi)))
    assert np.mean(new) >= 0.6 and np.mean(old) <= 0.35, (np.mean(new), np.mean(old))


def test_resampling_weights_a_sample_the_same_in_every_point():
    """Points share one validation split: a draw that drops the hard samples raises every point together."""
    rng = np.random.default_rng(3)
    split = split_of(rng)
    a, b = (validations(rng, split, [q] * 3) for q in (0.0, 1.0))
    b.ids, b.n, b.full = b.ids[::-1], b.n[:, ::-1], b.full[:, ::-1]  # another order: matched by id, not position
    scored = score_points([a, b], 300, seed=0)
    assert np.corrcoef(scored.draws.T)[0, 1] > 0.8
    assert scored.samples == N
