"""How much data buys how much acceptance: a saturating curve of tau against training tokens, fitted to the
data-scaling stage's points, with an uncertainty band, inverted for a target tau.

The curve:  tau(T) = 1 + (c - 1) / (1 + (T50 / T) ** b)      (1 <= c <= K + 1, b > 0)
With no data a drafter accepts nothing (tau = 1); with more it rises toward a ceiling c, never above K + 1 (a drafter
with K draft tokens accepts at most K + 1 per step); it is half-way there at T50 tokens, and b says how sharply it
turns (a sigmoid in log tokens). On the demo's seven points it fits with a residual of 0.09 tau, against 0.11 for a
power law c - a T^-b, whose ceiling ran past the flat top of the points.

Fitting: for each (b, T50) of a grid, refined once around the best cell, the curve is linear in c - 1, solved by least
squares with the caps applied; the pair with the smallest squared error wins. Exact and deterministic, no optimizer
to converge.
Band: the 10th..90th percentile of refitted curves. Refits to resampled points when the caller has them (the
data-scaling stage resamples validation samples, eagle3lib/analysis/scaling_points.py: the points' real,
correlated uncertainty, whatever the number of points); otherwise a parametric bootstrap, the fitted values plus
Gaussian noise of the points' spread (the residual spread when there are more points than parameters, never below
the measurement's own standard error). The tokens needed for a target tau come from the same refits, with the share
of refits in which the target is above the ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

B_GRID = np.geomspace(0.2, 8.0, 64)  # steepness tried (then refined)
T50_SPAN = 100.0  # T50 tried from the smallest point's tokens / this to the largest's x this
MIN_POINTS = 3  # three parameters: fewer distinct points cannot be extrapolated


@dataclass(frozen=True)
class Curve:
    c: float  # the ceiling tau approaches with unlimited data
    t50: float  # training tokens at which tau is half-way from 1 to c
    b: float  # how sharply it turns (in log tokens)

    def tau(self, tokens: np.ndarray | float) -> np.ndarray:
        t = np.asarray(tokens, dtype=float)
        return 1.0 + (self.c - 1.0) / (1.0 + (self.t50 / t) ** self.b)

    def tokens_for(self, target: float) -> float:
        """Training tokens at which the curve reaches `target`; inf when it is at or above the ceiling."""
        if target >= self.c:
            return math.inf
        if target <= 1.0:
            return 0.0
        r = (target - 1.0) / (self.c - 1.0)
        return self.t50 * (r / (1.0 - r)) ** (1.0 / self.b)


def _solve(t: np.ndarray, y: np.ndarray, bs: np.ndarray, t50s: np.ndarray, cap: float | None):
    """Least squares of c - 1 for every (b, T50) pair: returns (c, sse), each [len(bs), len(t50s)]."""
    h = 1.0 / (1.0 + (t50s[None, :, None] / t[None, None, :]) ** bs[:, None, None])  # [b, T50, points]
    g = np.maximum(0.0, (h * (y - 1.0)).sum(-1) / (h * h).sum(-1))  # c - 1, never below: tau >= 1
    if cap is not None:
        g = np.minimum(g, cap - 1.0)
    return 1.0 + g, (((1.0 + g[..., None] * h) - y) ** 2).sum(-1)


def _fit_once(t: np.ndarray, y: np.ndarray, cap: float | None) -> tuple[Curve, float]:
    """The grid fit, then a finer grid over the best cell's neighbours; returns (curve, squared error)."""
    bs, t50s = B_GRID, np.geomspace(t.min() / T50_SPAN, t.max() * T50_SPAN, 96)
    for _ in range(2):
        c, sse = _solve(t, y, bs, t50s, cap)
        i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
        best = Curve(float(c[i, j]), float(t50s[j]), float(bs[i])), float(sse[i, j])
        bs = np.geomspace(bs[max(i - 1, 0)], bs[min(i + 1, len(bs) - 1)], 24)
        t50s = np.geomspace(t50s[max(j - 1, 0)], t50s[min(j + 1, len(t50s) - 1)], 24)
    return best


@dataclass
class ScalingFit:
    curve: Curve | None  # None when the points cannot be fitted (fewer than MIN_POINTS distinct token counts)
    tokens: list[float]  # the points fitted
    tau: list[float]
    sigma: float  # the noise the band assumes (tau units)
    draws: list[Curve] = field(default_factory=list)  # the bootstrap refits (the curve alone when the points fit
    # exactly and the measurement has no error); empty exactly when there is no curve
    reason: str = ""  # why there is no curve

    def band(self, tokens: np.ndarray, lo: float = 10, hi: float = 90) -> tuple[np.ndarray, np.ndarray]:
        """The lo..hi percentile of the refitted curves at each of `tokens`."""
        ys = np.stack([d.tau(tokens) for d in self.draws])
        return np.percentile(ys, lo, axis=0), np.percentile(ys, hi, axis=0)

    def ceiling_range(self, lo: float = 10, hi: float = 90) -> tuple[float, float]:
        """The lo..hi percentile of the refits' ceilings."""
        c_lo, c_hi = np.percentile([d.c for d in self.draws], [lo, hi])
        return float(c_lo), float(c_hi)

    def needed(self, target: float) -> dict[str, float | None]:
        """Training tokens for `target`: the fit's value, the 10th..90th percentile of the refits, and the share of
        refits in which the target is above the ceiling (then no amount of data reaches it)."""
        if self.curve is None:
            return {"tokens": None, "tokens_lo": None, "tokens_hi": None, "unreachable_frac": None}
        ts = np.array([d.tokens_for(target) for d in self.draws])
        lo, hi = np.percentile(ts, [10, 90], method="nearest")  # nearest: no inf - inf between refits
        return {"tokens": self.curve.tokens_for(target), "tokens_lo": float(lo), "tokens_hi": float(hi),
                "unreachable_frac": float(np.mean(~np.isfinite(ts)))}


def fit_scaling(tokens: list[float], tau: list[float], *, cap: float | None, sigma_floor: float = 0.0,
                draws: int = 300, seed: int = 0, resampled: np.ndarray | None = None) -> ScalingFit:
    """Fit tau(T) to the points (tokens, tau). `cap` is the largest possible tau (K + 1). The band: refits to
    `resampled` [draws, points] (the points measured again under resampling) when given, else to Gaussian noise of
    the residual spread, never below `sigma_floor` (the measurement's own standard error)."""
    t = np.asarray(tokens, dtype=float)
    y = np.asarray(tau, dtype=float)
    if len(set(t.tolist())) < MIN_POINTS:
        return ScalingFit(None, t.tolist(), y.tolist(), sigma_floor,
                          reason=f"{len(set(t.tolist()))} distinct data size(s): a curve needs at least {MIN_POINTS} "
                                 "(one point cannot be extrapolated; train on nested fractions of the data)")
    curve, sse = _fit_once(t, y, cap)
    if resampled is not None:
        ys = np.asarray(resampled, dtype=float)
        sigma = float(np.median(np.std(ys, axis=0, ddof=1)))
        return ScalingFit(curve, t.tolist(), y.tolist(), sigma, [_fit_once(t, row, cap)[0] for row in ys])
    n, p = len(y), 3
    resid_sigma = math.sqrt(sse / (n - p)) if n > p else 0.0
    sigma = max(resid_sigma, sigma_floor)
    rng = np.random.default_rng(seed)
    fitted = curve.tau(t)
    refits = [_fit_once(t, fitted + rng.normal(0.0, sigma, n), cap)[0] for _ in range(draws)] if sigma > 0 else [curve]
    return ScalingFit(curve, t.tolist(), y.tolist(), sigma, refits)


def tau_standard_error(val_rec: dict, ttt_steps: int, positions: float) -> float:
    """Binomial standard error of a validation's tau estimate, tau = 1 + sum_k p_k (p_k = full acceptance rate at
    draft position k over `positions` counted positions). Positions are treated as independent, and the steps too,
    so this is a floor: an answer's positions are correlated. Used only for runs without per-sample counts."""
    var = 0.0
    for k in range(ttt_steps):
        p = val_rec.get(f"full_acc_{k}")
        if p is not None:
            var += float(p) * (1 - float(p)) / max(1.0, positions)
    return math.sqrt(var)


def explain(fit: ScalingFit, target: float, tokens_per_sample: float, cap: float | None = None) -> str:
    """Two sentences a person reads: what the curve says, and what the target needs."""
    if fit.curve is None:
        return f"No curve: {fit.reason}."
    cv = fit.curve
    c_lo, c_hi = fit.ceiling_range()
    if cap is not None and cv.c >= cap - 1e-9:
        s = (f"The points are still rising steeply: the fit runs into the most any drafter can reach (K + 1 = "
             f"{cap:g} tokens per step), so these points do not say where acceptance levels off.")
    else:
        s = (f"Acceptance rises from 1 (no data) toward a ceiling near tau {cv.c:.2f} ({c_lo:.2f}-{c_hi:.2f} across "
             f"the refits), half-way there at ~{cv.t50:,.0f} training tokens (~{cv.t50 / tokens_per_sample:,.0f} "
             "samples).")
    need = fit.needed(target)
    if need["tokens"] is None or not math.isfinite(need["tokens"]):
        return s + f" The target tau {target:.2f} is above the fitted ceiling: more data of this kind will not reach it."
    t = need["tokens"]
    rng = (f"{need['tokens_lo']:,.0f}-{need['tokens_hi']:,.0f}" if math.isfinite(need["tokens_hi"])
           else f"at least {need['tokens_lo']:,.0f}; above the ceiling in {need['unreachable_frac']:.0%} of refits")
    have = max(fit.tokens)
    where = "already reached" if t <= have else f"{t / have:.1f}x the largest point's data"
    return s + (f" Tau {target:.2f} needs ~{t:,.0f} training tokens (~{t / tokens_per_sample:,.0f} samples; {rng}): "
                f"{where}.")
