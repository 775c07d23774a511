"""The clock the engine's decisions read: monotonic time and idle waits.

Every reading of time on the decision path (when a request queued, how long a step took,
a staging deadline, an idle pause between polls) goes through a `Clock`, so the same
scheduler, admission and KV connector code can run against simulated time
(tierguard/predict) as well as the wall clock. Contract: `monotonic()` never decreases;
`sleep(s)` returns once `monotonic()` has advanced by at least `s`. `SYSTEM_CLOCK` is
`time.monotonic` and `time.sleep`, the default everywhere, so an engine built without a
clock behaves exactly as before.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The wall clock (CLOCK_MONOTONIC)."""

    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)


SYSTEM_CLOCK: Clock = SystemClock()
