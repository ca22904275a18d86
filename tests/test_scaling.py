# .venv/bin/python -m pytest -q tests/test_scaling.py
"""The data-scaling fit (eagle3lib/analysis/scaling.py) on synthetic points with a known curve: it recovers the
parameters, its band covers the truth, it inverts a target within the band, says when a target is above the ceiling,
and refuses to draw a curve through fewer than three data sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle3lib.analysis.scaling import Curve, explain, fit_scaling, tau_standard_error

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


def test_tau_standard_error_is_binomial():
    rec = {"full_acc_0": 0.8, "full_acc_1": 0.6, "full_acc_2": 0.4}
    se = tau_standard_error(rec, 3, positions=1000)
    assert se == pytest.approx(math.sqrt((0.16 + 0.24 + 0.24) / 1000))
