"""A circuit breaker for a network store: after a few failures in a row, stop trying for a
while, then let one probe through.

Why: a remote KV tier that is down must cost the engine nothing. With the breaker open,
reads and writes fail at once (a counted miss, recomputed), no thread waits on a socket,
and `/health` says why. The first call after the cool-down is the probe (half-open);
its success closes the breaker, its failure opens it again for twice as long (capped),
so a dead server is asked at most once per `max_open_s`.

    closed --(failures_to_open failures in a row)--> open --(open_s passed)--> half-open
    half-open --success--> closed;  half-open --failure--> open (open_s doubled, capped)

Thread-safe; the clock is injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(
        self,
        failures_to_open: int = 3,
        open_s: float = 0.5,
        max_open_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures_to_open < 1 or open_s <= 0 or max_open_s < open_s:
            raise ValueError("breaker needs failures_to_open >= 1 and 0 < open_s <= max_open_s")
        self.failures_to_open = failures_to_open
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0  # in a row
        self._open_s = open_s
        self._reopen_at = 0.0
        self._probing = False
        self.last_error = ""
        self.opened = 0  # times it opened from closed: outages seen (a counter for /metrics)

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def failing(self) -> bool:
        """True unless the last call succeeded (open, half-open, or closed after a failure)."""
        with self._lock:
            return self._state != CLOSED or self._failures > 0

    def allow(self) -> bool:
        """May a call go to the store now? Open: no, until the cool-down ends; then exactly
        one caller gets True (the probe) until it reports its outcome."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._clock() >= self._reopen_at:
                self._state = HALF_OPEN
                self._probing = False
            if self._state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> bool:
        """Record a call that reached the store; True if this closed an open breaker."""
        with self._lock:
            reopened = self._state != CLOSED
            self._state, self._failures, self._probing = CLOSED, 0, False
            self._open_s = self.base_open_s
            self.last_error = ""
            return reopened

    def failure(self, error: str) -> None:
        """Record a call that could not reach the store (connection refused, timeout...)."""
        with self._lock:
            self.last_error = error
            self._failures += 1
            if self._state == HALF_OPEN or self._failures >= self.failures_to_open:
                if self._state == HALF_OPEN:
                    self._open_s = min(self.max_open_s, 2 * self._open_s)
                if self._state == CLOSED:
                    self.opened += 1  # an outage began (a failed probe is the same outage)
                self._state, self._probing = OPEN, False
                self._reopen_at = self._clock() + self._open_s


class BreakerSet:
    """One `CircuitBreaker` per store node, all with the same settings, made on first use.

    Why per node: in a Redis Cluster each master serves its own slots, so one that is
    down or hung must open only its own breaker; the blocks on the other masters keep
    their round trips. A node that left the cluster keeps its breaker (it is no longer
    asked), so `opened` counts every outage seen."""

    def __init__(self, **settings) -> None:
        CircuitBreaker(**settings)  # the settings are checked once, here
        self._settings = settings
        self._lock = threading.Lock()
        self._breakers: dict[str, CircuitBreaker] = {}

    def __getitem__(self, node: str) -> CircuitBreaker:
        with self._lock:
            b = self._breakers.get(node)
            if b is None:
                b = self._breakers[node] = CircuitBreaker(**self._settings)
            return b

    def items(self) -> list[tuple[str, CircuitBreaker]]:
        with self._lock:
            return list(self._breakers.items())

    @property
    def opened(self) -> int:
        return sum(b.opened for _, b in self.items())
