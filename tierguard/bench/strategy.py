"""Load strategies: when is the next request due, and how many may be in flight.

Arrivals and concurrency are separate knobs (R9). An `Arrivals` strategy only answers
"when is the next request due" as an offset in seconds from the start of the run; it
knows nothing of HTTP. `ConcurrencyLimiter` bounds requests in flight and measures how
long each one waited for a slot, because that wait is latency the user feels even though
the server never saw the request.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod

import numpy as np


class Arrivals(ABC):
    """Produces due times; `next_due(previous)` is monotone non-decreasing."""

    @abstractmethod
    def next_due(self, previous_s: float) -> float: ...

    def schedule(self, n: int | None = None, duration_s: float | None = None) -> list[float]:
        """The first `n` due times, or all due times before `duration_s`, whichever ends first."""
        if n is None and duration_s is None:
            raise ValueError("schedule needs n or duration_s")
        out: list[float] = []
        t = 0.0
        first = True
        while n is None or len(out) < n:
            t = 0.0 if first and self.starts_at_zero else self.next_due(t)
            first = False
            if duration_s is not None and t >= duration_s:
                break
            out.append(t)
        return out

    starts_at_zero = True


class GammaArrivals(Arrivals):
    """Gamma inter-arrival times with mean 1/rate; burstiness 1 is Poisson.

    Shape = burstiness, scale = 1 / (rate × burstiness): burstiness < 1 makes bursts and
    lulls, > 1 makes arrivals more regular, the mean rate stays `rate`.
    """

    starts_at_zero = False

    def __init__(self, rate: float, burstiness: float = 1.0, seed: int = 0) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError("rate must be positive and finite")
        self.rate, self.burstiness = rate, burstiness
        self.rng = np.random.default_rng(seed)

    def next_due(self, previous_s: float) -> float:
        return previous_s + float(self.rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness)))


class ImmediateArrivals(Arrivals):
    """Rate inf: everything is due at once (closed loop when a concurrency limit exists)."""

    def next_due(self, previous_s: float) -> float:
        return previous_s


class TraceArrivals(Arrivals):
    """Replays recorded offsets (seconds from the first request)."""

    def __init__(self, offsets_s: list[float]) -> None:
        self.offsets = sorted(offsets_s)
        self._i = 0

    def next_due(self, previous_s: float) -> float:
        self._i = min(self._i + 1, len(self.offsets) - 1)
        return self.offsets[self._i]

    def schedule(self, n: int | None = None, duration_s: float | None = None) -> list[float]:
        out = [t for t in self.offsets if duration_s is None or t < duration_s]
        return out[:n] if n is not None else out


def make_arrivals(rate: float, burstiness: float, seed: int) -> Arrivals:
    if math.isinf(rate):
        return ImmediateArrivals()
    return GammaArrivals(rate, burstiness, seed)


class ConcurrencyLimiter:
    """At most `limit` holders; `acquire()` returns the seconds spent waiting.

    Invariant: 0 <= in_flight <= limit (limit None: unbounded, never waits).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._sem = asyncio.Semaphore(limit) if limit else None
        self.in_flight = 0

    async def acquire(self) -> float:
        start = time.monotonic()
        if self._sem is not None:
            await self._sem.acquire()
        self.in_flight += 1
        return time.monotonic() - start

    def release(self) -> None:
        self.in_flight -= 1
        if self._sem is not None:
            self._sem.release()
