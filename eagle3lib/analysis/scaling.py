"""How much data buys how much acceptance: a saturating curve of tau against training tokens, fitted to the
data-scaling stage's points, with an uncertainty band, inverted for a target tau.

The curve:  tau(T) = c - a * (T / T_ref) ** -b    (a >= 0, 0 < b <= 3, c <= K + 1)
Acceptance rises with data and levels off at a ceiling c: a drafter with K draft tokens accepts at most K + 1 per
step, so c is capped there; b says how fast the gap to the ceiling closes (halving the gap takes 2 ** (1 / b) times
the tokens). T_ref, the largest point's tokens, only conditions the numbers.

Fitting: for each b on a fine grid the curve is linear in (c, a), solved by least squares (with the caps applied);
the b with the smallest squared error wins. Exact and deterministic, no optimizer to converge.
Band: parametric bootstrap. Refit the curve to the fitted values plus Gaussian noise of the points' spread (the
residual spread when there are more points than parameters, never below the measurement's own standard error),
and take the 10th..90th percentile of the refitted curves. The tokens needed for a target tau come from the same
refits, with the share of refits in which the target is above the ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

B_GRID = np.geomspace(0.03, 3.0, 400)  # exponents tried
MIN_POINTS = 3  # three parameters: fewer distinct points cannot be extrapolated


@dataclass(frozen=True)
class Curve:
    c: float  # the ceiling tau approaches with unlimited data
    a: float  # the gap below the ceiling at T_ref
    b: float  # how fast the gap closes with more tokens
    t_ref: float  # tokens of the largest point

    def tau(self, tokens: np.ndarray | float) -> np.ndarray:
        return self.c - self.a * (np.asarray(tokens, dtype=float) / self.t_ref) ** (-self.b)

    def tokens_for(self, target: float) -> float:
        """Training tokens at which the curve reaches `target`; inf when it is at or above the ceiling."""
        if target >= self.c:
            return math.inf
        if self.a <= 0:
            return 0.0
        return self.t_ref * ((self.c - target) / self.a) ** (-1.0 / self.b)


def _fit_once(x: np.ndarray, y: np.ndarray, cap: float | None) -> tuple[Curve, float]:
    """Least-squares fit of c - a * x ** -b (x already divided by T_ref), every b of the grid at once; returns (curve,
    squared error)."""
    z = x[None, :] ** (-B_GRID[:, None])  # [grid, points]
    zc, yc = z - z.mean(1, keepdims=True), y - y.mean()
    var = (zc * zc).sum(1)
    a = np.where(var > 0, np.maximum(0.0, -(zc @ yc) / np.where(var > 0, var, 1.0)), 0.0)  # tau must not fall with data
    c = y.mean() + a * z.mean(1)
    if cap is not None:  # a ceiling above K + 1 is impossible: refit the gap with c fixed at the cap
        over = c > cap
        a = np.where(over, np.maximum(0.0, (z @ (cap - y)) / (z * z).sum(1)), a)
        c = np.where(over, cap, c)
    sse = (((c[:, None] - a[:, None] * z) - y) ** 2).sum(1)
    i = int(np.argmin(sse))
    return Curve(float(c[i]), float(a[i]), float(B_GRID[i]), 1.0), float(sse[i])


@dataclass
class ScalingFit:
    curve: Curve | None  # None when the points cannot be fitted (fewer than MIN_POINTS distinct token counts)
    tokens: list[float]  # the points fitted
    tau: list[float]
    sigma: float  # the noise the band assumes (tau units)
    draws: list[Curve] = field(default_factory=list)  # the bootstrap refits
    reason: str = ""  # why there is no curve

    def band(self, tokens: np.ndarray, lo: float = 10, hi: float = 90) -> tuple[np.ndarray, np.ndarray]:
        """The lo..hi percentile of the refitted curves at each of `tokens`."""
        ys = np.stack([d.tau(tokens) for d in self.draws])
        return np.percentile(ys, lo, axis=0), np.percentile(ys, hi, axis=0)

    def needed(self, target: float) -> dict[str, float | None]:
        """Training tokens for `target`: the fit's value, the 10th..90th percentile of the refits, and the share of
        refits in which the target is above the ceiling (then no amount of data reaches it)."""
        if self.curve is None:
            return {"tokens": None, "tokens_lo": None, "tokens_hi": None, "unreachable_frac": None}
        ts = np.array([d.tokens_for(target) for d in self.draws]) if self.draws else np.array([self.curve.tokens_for(target)])
        lo, hi = np.percentile(ts, [10, 90], method="nearest")  # nearest: no inf - inf between refits
        return {"tokens": self.curve.tokens_for(target), "tokens_lo": float(lo), "tokens_hi": float(hi),
                "unreachable_frac": float(np.mean(~np.isfinite(ts)))}


def fit_scaling(tokens: list[float], tau: list[float], *, cap: float | None, sigma_floor: float = 0.0,
                draws: int = 300, seed: int = 0) -> ScalingFit:
    """Fit tau(T) to the points (tokens, tau). `cap` is the largest possible tau (K + 1); `sigma_floor` the
    measurement's own standard error, the least noise the band assumes."""
    t = np.asarray(tokens, dtype=float)
    y = np.asarray(tau, dtype=float)
    if len(set(t.tolist())) < MIN_POINTS:
        return ScalingFit(None, t.tolist(), y.tolist(), sigma_floor,
                          reason=f"{len(set(t.tolist()))} distinct data size(s): a curve needs at least {MIN_POINTS} "
                                 "(one point cannot be extrapolated; train on nested fractions of the data)")
    t_ref = float(t.max())
    x = t / t_ref
    curve, sse = _fit_once(x, y, cap)
    n, p = len(y), 3
    resid_sigma = math.sqrt(sse / (n - p)) if n > p else 0.0
    sigma = max(resid_sigma, sigma_floor)
    rng = np.random.default_rng(seed)
    fitted = curve.tau(x)
    refits = [_fit_once(x, fitted + rng.normal(0.0, sigma, n), cap)[0] for _ in range(draws)] if sigma > 0 else [curve]
    scale = lambda cv: Curve(cv.c, cv.a, cv.b, t_ref)  # noqa: E731
    return ScalingFit(scale(curve), t.tolist(), y.tolist(), sigma, [scale(r) for r in refits])


def tau_standard_error(val_rec: dict, ttt_steps: int, positions: float) -> float:
    """Binomial standard error of a validation's tau estimate, tau = 1 + sum_k p_k (p_k = full acceptance rate at
    draft position k over `positions` counted positions); positions are treated as independent, so this is a floor."""
    var = 0.0
    for k in range(ttt_steps):
        p = val_rec.get(f"full_acc_{k}")
        if p is not None:
            var += float(p) * (1 - float(p)) / max(1.0, positions)
    return math.sqrt(var)


def explain(fit: ScalingFit, target: float, tokens_per_sample: float) -> str:
    """Two sentences a person reads: what the curve says, and what the target needs."""
    if fit.curve is None:
        return f"No curve: {fit.reason}."
    cv = fit.curve
    lo, hi = fit.band(np.array([cv.t_ref * 1e6]))  # far beyond the data: the ceiling's own spread
    s = (f"Acceptance levels off near tau {cv.c:.2f} (band {lo[0]:.2f}-{hi[0]:.2f} with unlimited data); each "
         f"halving of the gap to that ceiling takes {2 ** (1 / cv.b):.1f}x the training tokens.")
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
