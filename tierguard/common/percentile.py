"""The one percentile definition behind every figure tierguard prints.

Definition: linear interpolation between closest ranks, numpy's default `method="linear"`
(type 7 of Hyndman and Fan). For n ascending values x[0] .. x[n-1], the q-th percentile
sits at rank h = (n - 1) * q / 100 and is

    x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])

It is what `vllm bench serve` reports (it calls `numpy.percentile` with the default
method) and what guidellm's percentiles follow, so a tierguard p99 compares with theirs
taken on the same samples. For the values 1 .. 100: p50 = 50.5, p99 = 99.01, p100 = 100.

Callers may assume:
  - the input need not be sorted and is never modified;
  - `+inf` is a value like any other (a failed request counted as a miss): a rank that
    falls on an infinite value, or between a finite one and an infinite one, gives
    `inf`, never NaN (numpy's own interpolation gives NaN there);
  - empty input gives `empty` (None unless the caller names another value);
  - `q` outside [0, 100] or a NaN among the values is a ValueError, not a quiet number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def _sorted(values: Iterable[float] | np.ndarray) -> np.ndarray:
    a = np.sort(np.asarray(values if isinstance(values, np.ndarray | Sequence) else list(values), dtype=float),
                axis=None)
    if a.size and math.isnan(a[-1]):  # np.sort puts NaN last
        raise ValueError("percentile of values that include NaN")
    return a


def _at(a: np.ndarray, q: float) -> float:
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q!r}")
    h = (a.size - 1) * q / 100.0
    lo = math.floor(h)
    frac = h - lo
    low = float(a[lo])
    if frac == 0.0 or lo + 1 >= a.size:
        return low
    high = float(a[lo + 1])
    if math.isinf(high) or high == low:
        return high
    return low + frac * (high - low)


def percentile(values: Iterable[float] | np.ndarray, q: float, empty: float | None = None) -> float | None:
    """The q-th percentile (q in 0..100) of `values`; `empty` when there are none."""
    a = _sorted(values)
    return empty if a.size == 0 else _at(a, q)


def percentiles(values: Iterable[float] | np.ndarray, qs: Sequence[float]) -> list[float] | None:
    """Several percentiles of one sample, sorted once; None when there are no values."""
    a = _sorted(values)
    return None if a.size == 0 else [_at(a, q) for q in qs]
