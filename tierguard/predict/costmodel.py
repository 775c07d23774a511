"""Step cost: how long an engine step of a given shape takes, fitted on measured steps.

A step is described by its `StepShape` (tierguard/engine/api.py): one-token rows and the
keys they attend, prefill chunks with their tokens and keys, sampled rows. Its time is a
non-negative linear function of a few of those numbers, one function per *regime* (a
compute path with its own fixed cost):

    decode   only one-token rows            t = a0 + a1 x rows + a2 x keys
    fused    chunks, rows <= fused_max_rows  t = b0 + b1 x rows + b2 x keys + b3 x sampled
    wide     chunks, more rows               t = c0 + c1 x rows + c2 x keys + c3 x sampled + c4 x chunks

(`rows`/`keys` count one-token rows and chunk tokens together.) For our engine the
regimes are the model runner's paths: the native decode kernel, the fused whole-step
kernel for steps of up to `fused_max_rows` rows, and the per-op path beyond it; an
engine without the fused path has only `decode` and `wide`. External engines
(tierguard/predict/generic.py) use `decode` and `chunk`, the second being the decode
function plus a prefill part, fitted from client-side timings.

Fitting is relative least squares with non-negative coefficients (every step counts by
its error relative to the fitted time, so short decode steps are not drowned by long
prefills, and one step that came out absurdly short cannot pull the line to zero;
iteratively reweighted, `fit_relative`). What the
line does not explain is kept as an empirical distribution of log residuals per regime;
a simulated step draws one, so the spread of real steps (noise, a loaded machine)
reaches the predicted p99, not only their mean.

Real steps are not independent draws: a slow step (another process on the cores, a
cold cache) is followed by more slow steps, and a prefill of several chunks or a wait
behind many steps sums such a run. `StepCost.rho` is the lag-1 correlation of the
calibration's residuals in step order (in normal scores), and `StepNoise` replays it: a
Gaussian AR(1) whose value, through the normal distribution function, picks the
quantile of the regime's residuals. Each regime keeps its measured distribution
exactly; successive steps keep the measured correlation.

Contract: `step_seconds` is positive for any shape with at least one row; with neither
`rng` nor `u` it is the fitted mean. `to_json`/`from_json` round-trip exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from tierguard.engine.api import StepShape

REGIME_FEATURES: dict[str, tuple[str, ...]] = {
    "decode": ("1", "token_rows", "token_row_keys"),
    "fused": ("1", "rows", "keys", "sampled"),
    "wide": ("1", "rows", "keys", "sampled", "chunks"),
    "chunk": ("1", "token_rows", "token_row_keys", "has_chunk", "chunk_tokens", "chunk_keys"),
}
MAX_RESIDUALS = 2000  # log residuals kept per regime (a random subsample beyond)
MIN_SECONDS = 1e-6
MAX_RHO = 0.95  # a fitted correlation is capped: a draw always moves
_NORMAL = NormalDist()


def feature(shape: StepShape, name: str) -> float:
    if name == "1":
        return 1.0
    if name == "rows":
        return float(shape.token_rows + shape.chunk_tokens)
    if name == "keys":
        return float(shape.token_row_keys + shape.chunk_keys)
    if name == "has_chunk":
        return float(shape.chunks > 0)
    return float(getattr(shape, name))


def fit_relative(a: np.ndarray, y: np.ndarray, rounds: int = 5) -> np.ndarray:
    """Non-negative x minimizing sum(((a x - y) / (a x))^2), by reweighting: the first
    round weighs every point alike, each later one by 1 / its fitted value."""
    w = np.full(y.shape, 1.0 / max(float(np.mean(np.abs(y))), MIN_SECONDS))
    x = np.zeros(a.shape[1])
    for _ in range(rounds):
        x = nnls(a * w[:, None], y * w)
        w = 1.0 / np.maximum(a @ x, max(MIN_SECONDS, 1e-3 * float(np.median(np.abs(y)))))
    return x


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson-Hanson active set; a has few columns)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        cand = np.where(~passive & (w > 1e-12 * (1 + np.abs(w).max())))[0]
        if cand.size == 0:
            break
        passive[cand[np.argmax(w[cand])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            if not passive.any():
                break
    return x


@dataclass
class Linear:
    """t = sum(coef[i] x feature[i]) seconds, with the log residuals of its fit."""

    features: tuple[str, ...]
    coef: list[float]
    residuals: list[float] = field(default_factory=list)
    points: int = 0
    _ordered: list[float] | None = field(default=None, init=False, repr=False, compare=False)

    def mean(self, shape: StepShape) -> float:
        return max(MIN_SECONDS, sum(c * feature(shape, f) for c, f in zip(self.coef, self.features, strict=True)))

    def noise(self, rng: np.random.Generator | None) -> float:
        if rng is None or not self.residuals:
            return 1.0
        return math.exp(self.residuals[int(rng.integers(len(self.residuals)))])

    def noise_at(self, u: float) -> float:
        """The factor at quantile `u` (0 <= u < 1) of the residuals' distribution."""
        if not self.residuals:
            return 1.0
        ordered = self._sorted()
        return math.exp(ordered[min(len(ordered) - 1, max(0, int(u * len(ordered))))])

    def _sorted(self) -> list[float]:
        if self._ordered is None or len(self._ordered) != len(self.residuals):
            self._ordered = sorted(self.residuals)
        return self._ordered

    @classmethod
    def fit(cls, features: tuple[str, ...], shapes: list[StepShape], seconds: list[float]) -> Linear:
        """Relative NNLS over (shape, seconds) points; residuals are log(seconds / fit)."""
        y = np.asarray(seconds, dtype=float)
        a = np.asarray([[feature(s, f) for f in features] for s in shapes], dtype=float)
        coef = fit_relative(a, y)
        fitted = np.maximum(a @ coef, MIN_SECONDS)
        res = np.log(np.maximum(y, MIN_SECONDS) / fitted)
        res -= np.log(np.mean(np.exp(res)))  # the draws average to the fitted mean
        if res.size > MAX_RESIDUALS:
            res = np.random.default_rng(0).choice(res, MAX_RESIDUALS, replace=False)
        return cls(tuple(features), [float(c) for c in coef], [round(float(r), 5) for r in res], int(y.size))

    def to_json(self) -> dict:
        return {"features": list(self.features), "coef": self.coef, "residuals": self.residuals,
                "points": self.points}

    @classmethod
    def from_json(cls, d: dict) -> Linear:
        return cls(tuple(d["features"]), list(d["coef"]), list(d.get("residuals", [])), int(d.get("points", 0)))


@dataclass
class StepCost:
    """Seconds of a step by regime, and of the engine's work between steps (`gap`:
    handing outputs to the front end; linear in the step's sampled rows)."""

    regimes: dict[str, Linear]
    fused_max_rows: int = 0  # 0: no fused path (decode / wide only, or an external engine)
    generic: bool = False  # external engine: regimes decode / chunk
    gap: Linear | None = None
    rho: float = 0.0  # lag-1 correlation of successive steps' residuals (normal scores)

    def regime(self, shape: StepShape) -> str:
        if shape.chunks == 0:
            return "decode"
        if self.generic:
            return "chunk"
        rows = shape.token_rows + shape.chunk_tokens
        if self.fused_max_rows and rows <= self.fused_max_rows and "fused" in self.regimes:
            return "fused"
        return "wide" if "wide" in self.regimes else "fused"

    def step_seconds(self, shape: StepShape, rng: np.random.Generator | None = None, scale: float = 1.0,
                     u: float | None = None) -> float:
        """The step's seconds: the fitted mean times a residual, at quantile `u` when
        given (`StepNoise`), else an independent draw from `rng`, else none."""
        line = self.regimes[self.regime(shape)]
        factor = line.noise_at(u) if u is not None else line.noise(rng)
        return line.mean(shape) * factor * scale

    def residual_correlation(self, shapes: list[StepShape], seconds: list[float]) -> float:
        """The lag-1 correlation of these steps' residuals, in the order given, each as
        the normal score of its rank within its regime; 0 for fewer than 10 steps."""
        by_regime: dict[str, list[tuple[float, int]]] = {}
        for i, (shape, t) in enumerate(zip(shapes, seconds, strict=True)):
            name = self.regime(shape)
            by_regime.setdefault(name, []).append((math.log(max(t, MIN_SECONDS) / self.regimes[name].mean(shape)), i))
        scores = [0.0] * len(shapes)
        for pts in by_regime.values():
            for (_, i), score in zip(pts, normal_scores([r for r, _ in pts]), strict=True):
                scores[i] = score
        return lag1_correlation(scores)

    def gap_seconds(self, sampled: int, rng: np.random.Generator | None = None, scale: float = 1.0) -> float:
        if self.gap is None:
            return 0.0
        shape = StepShape(sampled=sampled)
        return self.gap.mean(shape) * self.gap.noise(rng) * scale

    @classmethod
    def fit(
        cls,
        shapes: list[StepShape],
        seconds: list[float],
        fused_max_rows: int = 0,
        gaps: list[tuple[int, float]] | None = None,
    ) -> StepCost:
        """Fit every regime that has at least 3 points; `regime` sends a step of a regime
        without a line to the other chunk regime."""
        groups: dict[str, tuple[list[StepShape], list[float]]] = {}
        for s, t in zip(shapes, seconds, strict=True):
            name = "decode" if s.chunks == 0 else (
                "fused" if fused_max_rows and s.token_rows + s.chunk_tokens <= fused_max_rows else "wide")
            groups.setdefault(name, ([], []))
            groups[name][0].append(s)
            groups[name][1].append(t)
        regimes = {name: Linear.fit(REGIME_FEATURES[name], *pts) for name, pts in groups.items() if len(pts[0]) >= 3}
        if "decode" not in regimes:
            raise ValueError("the calibration has fewer than 3 decode-only steps: nothing to fit")
        if "fused" not in regimes and "wide" not in regimes:
            raise ValueError("the calibration has fewer than 3 steps with prefill chunks: nothing to fit")
        gap = None
        if gaps and len(gaps) >= 3:
            gap = Linear.fit(("1", "sampled"), [StepShape(sampled=n) for n, _ in gaps], [g for _, g in gaps])
        return cls(regimes, fused_max_rows, False, gap)

    def to_json(self) -> dict:
        return {
            "regimes": {k: v.to_json() for k, v in self.regimes.items()},
            "fused_max_rows": self.fused_max_rows,
            "generic": self.generic,
            "gap": self.gap.to_json() if self.gap else None,
            "rho": self.rho,
        }

    @classmethod
    def from_json(cls, d: dict) -> StepCost:
        return cls(
            {k: Linear.from_json(v) for k, v in d["regimes"].items()},
            int(d.get("fused_max_rows", 0)),
            bool(d.get("generic", False)),
            Linear.from_json(d["gap"]) if d.get("gap") else None,
            float(d.get("rho", 0.0)),
        )

    def describe(self) -> dict[str, dict[str, float]]:
        """Coefficients in ms (per unit of each feature), per regime: for docs and logs."""
        out = {name: {f: round(c * 1000.0, 5) for f, c in zip(line.features, line.coef, strict=True)}
               for name, line in self.regimes.items()}
        if self.gap is not None:
            out["gap"] = {f: round(c * 1000.0, 5) for f, c in zip(self.gap.features, self.gap.coef, strict=True)}
        return out


def normal_scores(values: list[float]) -> list[float]:
    """Each value as the standard normal quantile of its rank, (rank + 0.5) / n (ties in
    the order given): the shape of a distribution taken out, its order kept."""
    order = sorted(range(len(values)), key=values.__getitem__)
    scores = [0.0] * len(values)
    for rank, i in enumerate(order):
        scores[i] = _NORMAL.inv_cdf((rank + 0.5) / len(values))
    return scores


def lag1_correlation(values: list[float]) -> float:
    """Pearson correlation of each value with the next, within [0, MAX_RHO] (a negative
    one, alternation, is not something a simulated step should copy); 0 below 10 values."""
    if len(values) < 10:
        return 0.0
    a = np.asarray(values, dtype=float)
    x, y = a[:-1], a[1:]
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return round(float(min(MAX_RHO, max(0.0, np.corrcoef(x, y)[0, 1]))), 4)


class StepNoise:
    """Quantiles for a simulation's successive steps: z = rho z + sqrt(1 - rho^2) e,
    e standard normal, and u = Phi(z). With rho 0 every step draws independently; its
    marginal is uniform whatever rho, so each regime's residual distribution is kept."""

    def __init__(self, rho: float, rng: np.random.Generator) -> None:
        self.rho, self.rng = min(MAX_RHO, max(0.0, rho)), rng
        self.z = float(rng.standard_normal())

    def next(self) -> float:
        self.z = self.rho * self.z + math.sqrt(1.0 - self.rho * self.rho) * float(self.rng.standard_normal())
        return _NORMAL.cdf(self.z)
