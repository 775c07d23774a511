"""p99 with failures counted as misses, and a bootstrap interval around it.

Why a cluster bootstrap: the tokens of one request are not independent (one offload
stall stretches many gaps of the same request), so intervals are computed by
resampling whole requests and pooling their per-token samples, never single tokens.

A failed or rejected request is an infinite latency: it enters every distribution as
`inf`, so with 1 % of the requests failed or more the p99 is `inf` and the SLO is missed
(R11's "failures count as misses"). Quantiles follow the one percentile definition
(common/percentile.py), which keeps `inf` from turning into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierguard.common.percentile import percentile

METRICS = ("ttft", "itl", "tpot", "e2el")


@dataclass
class RequestSample:
    """What one request contributes to the distributions (milliseconds)."""

    ok: bool
    ttft_ms: float = math.inf
    itl_ms: Sequence[float] = ()  # per-token gaps; empty for one-token answers
    tpot_ms: float = math.inf
    e2el_ms: float = math.inf
    max_stall_ms: float = math.inf

    def values(self, metric: str) -> np.ndarray:
        if not self.ok:
            return np.array([math.inf])
        if metric == "itl":
            return np.asarray(self.itl_ms, dtype=float)
        return np.array([getattr(self, f"{metric}_ms")], dtype=float)


def quantile(values: np.ndarray, q: float) -> float:
    """The q-quantile (0..1) of `values`, an observed sample, by the one percentile
    definition (common/percentile.py); `inf` allowed. NaN if empty."""
    return percentile(values, 100 * q, empty=math.nan)  # type: ignore[return-value]


def pooled(samples: Sequence[RequestSample], metric: str) -> np.ndarray:
    parts = [s.values(metric) for s in samples]
    return np.concatenate(parts) if parts else np.array([])


@dataclass
class P99:
    """A p99 point estimate with its bootstrap interval (None when not computed)."""

    value: float
    low: float | None = None
    high: float | None = None

    def to_json(self) -> dict:
        return {
            "p99_ms": finite_or_none(self.value),
            "low_ms": finite_or_none(self.low),
            "high_ms": finite_or_none(self.high),
            "unbounded": self.value == math.inf,
        }

    @classmethod
    def from_json(cls, d: dict) -> P99:
        value = math.inf if d.get("unbounded") else d.get("p99_ms")
        return cls(
            value=math.nan if value is None else float(value),
            low=_inf_if_none(d.get("low_ms"), d),
            high=_inf_if_none(d.get("high_ms"), d),
        )


def _inf_if_none(v: float | None, d: dict) -> float | None:
    if v is None:
        return math.inf if d.get("unbounded") else None
    return float(v)


def finite_or_none(v: float | None) -> float | None:
    """JSON has no infinity: `null` plus an explicit `unbounded` flag carries it."""
    if v is None or not math.isfinite(v):
        return None
    return round(float(v), 3)


def p99_with_interval(
    samples: Sequence[RequestSample], metric: str, boot: int, confidence: float, seed: int = 0
) -> P99:
    """p99 of `metric` over all samples, with a (confidence) cluster-bootstrap interval."""
    point = quantile(pooled(samples, metric), 0.99)
    if boot <= 0 or len(samples) < 2 or math.isnan(point):
        return P99(point)
    rng = np.random.default_rng(seed)
    per_request = [s.values(metric) for s in samples]
    n = len(per_request)
    estimates = np.empty(boot)
    for b in range(boot):
        pick = rng.integers(0, n, size=n)
        pool = np.concatenate([per_request[i] for i in pick])
        estimates[b] = quantile(pool, 0.99) if pool.size else math.nan
    estimates = estimates[~np.isnan(estimates)]
    if estimates.size == 0:
        return P99(point)
    alpha = (1.0 - confidence) / 2.0
    return P99(point, quantile(estimates, alpha), quantile(estimates, 1.0 - alpha))


def cdf_points(values: np.ndarray, max_points: int = 200) -> tuple[list[float], list[float]]:
    """(x, F(x)) of the finite values, thinned to at most `max_points` for plotting."""
    v = np.sort(values[np.isfinite(values)])
    if v.size == 0:
        return [], []
    idx = np.unique(np.linspace(0, v.size - 1, min(max_points, v.size)).astype(int))
    return v[idx].tolist(), ((idx + 1) / v.size).tolist()
