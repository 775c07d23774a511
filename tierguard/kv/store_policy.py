"""Store admission: offload stores run under backpressure (policy, apart from the copies).

Two kinds of copy leave the device pool or host RAM:
  - promotions: loads of blocks a waiting request will use, and swap-outs of preempted
    sequences that will be restored. Someone is waiting for them; they are never refused
    here and run on the transfer worker's promotion lane.
  - stores: a finished sequence's blocks copied to host RAM ("offload"), and host blocks
    written behind to the cold media ("persist"). Nobody has asked for them yet; they pay
    off only if a later request reuses the prefix. They run on the store lane.

A tier must cost nothing when its blocks are not reused, so stores never take compute a
step is waiting for:
  - the store lane uses at most `share` of one core over time (a token bucket of CPU
    seconds: copies, checksums, encryption; waiting for a disk or a socket is free), so on
    a CPU, where those run on the cores that compute, stores borrow a bounded slice;
    idle time banks at most `burst_s` of store work (20 ms by default), so a lane that
    sat idle for an hour does not then run unthrottled;
  - at most `max_pending` stores wait or run at once; past that a new store is dropped
    and counted (the blocks stay where they are: on the device until evicted, or in host
    RAM without a disk copy). A dropped store costs only the chance of a later hit.

Contract for callers (TieredConnector, on the engine thread):
  - `admit(kind)` never waits; False means the store is dropped and already counted.
  - every admitted store is matched by exactly one `done(kind, seconds)` with the time
    its copy ran, from the completion the caller polls;
  - `allow_run(now)` is asked by the store lane before each job; it never blocks either.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tierguard.common.stats import counter, gauge

OFFLOAD = "offload"  # a finished sequence's blocks, device -> host RAM
PERSIST = "persist"  # host RAM -> the cold media (write-behind)
KINDS = (OFFLOAD, PERSIST)


@dataclass
class StoreStats:
    stores_admitted: dict[str, int] = counter("Offload stores admitted, by kind.", "stores_admitted_{key}", {})
    stores_dropped: dict[str, int] = counter(
        "Offload stores dropped under backpressure, by kind and reason.", "stores_dropped_{key}", {}
    )
    stores_pending: int = gauge("Offload stores waiting or running on the store lane.")
    store_seconds: float = counter("Wall seconds of the store lane's jobs.")
    store_deferrals: int = counter("Times the store lane waited for its share of the cores.")


class StorePolicy:
    """Bounded share and bounded backlog for stores. Thread-safe."""

    def __init__(
        self, max_pending: int = 4, share: float = 0.1, burst_s: float = 0.02, clock=time.monotonic
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self.max_pending, self.share, self.burst_s = max_pending, share, burst_s
        self._lock = threading.Lock()
        self._pending = 0
        self._tokens = burst_s  # seconds of store work the lane may run now
        self._clock = clock
        self._refilled = clock()
        self._stats = StoreStats(stores_admitted=dict.fromkeys(KINDS, 0))

    def admit(self, kind: str) -> bool:
        with self._lock:
            if self._pending >= self.max_pending:
                key = f"{kind}_backlog"
                self._stats.stores_dropped[key] = self._stats.stores_dropped.get(key, 0) + 1
                return False
            self._pending += 1
            self._stats.stores_admitted[kind] += 1
            return True

    def done(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._pending = max(0, self._pending - 1)
            self._stats.store_seconds += seconds

    def allow_run(self, now: float | None = None) -> bool:
        """Whether the store lane may start a job now: its share of wall time is not spent."""
        now = self._clock() if now is None else now
        with self._lock:
            self._tokens = min(self.burst_s, self._tokens + max(0.0, now - self._refilled) * self.share)
            self._refilled = now
            if self._tokens > 0:
                return True
            self._stats.store_deferrals += 1
            return False

    def charge(self, seconds: float) -> None:
        """The store lane's job used `seconds` of CPU: that much of its share is spent."""
        with self._lock:
            self._tokens -= seconds

    def stats(self) -> StoreStats:
        with self._lock:
            s = self._stats
            return StoreStats(
                dict(s.stores_admitted), dict(s.stores_dropped), self._pending, s.store_seconds, s.store_deferrals
            )
