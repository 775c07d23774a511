"""A fixed-bucket latency histogram that engine threads update and /metrics exports.

Why not prometheus_client's Histogram directly: the engine and the transfer workers
must not depend on the HTTP layer's registry (the engine also runs embedded, with no
server), so they count into this plain object and the server turns a snapshot of it
into a Prometheus histogram at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds: from a host<->device copy of one block (a fraction of a millisecond) to a slow
# cold read (seconds).
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass
class LatencyHistogram:
    """Counts per bucket (not cumulative); `counts[-1]` is the +Inf bucket.

    Not thread-safe by itself: the owner updates it under its own lock and hands out
    `snapshot()` copies.
    """

    bounds: tuple[float, ...] = TRANSFER_BUCKETS
    counts: list[int] = field(default_factory=list)
    total_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> LatencyHistogram:
        return LatencyHistogram(self.bounds, list(self.counts), self.total_s)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out
