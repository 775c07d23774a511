"""An asyncio event loop on virtual time, for tests of deadlines and time estimates.

`loop.time()` is a counter that moves only when the loop would otherwise sleep: then it
jumps to the next timer at once. So `asyncio.sleep(3)`, `asyncio.timeout(0.15)` and
`call_at` keep their exact order and their exact virtual times, however busy the machine
is, and a test of "refused at the deadline" can say "at the deadline" instead of "within
some wall-clock margin". Code under test must read the loop's clock (`loop.time`) where it
measures time (AdmissionController takes it as `clock`).

The loop still polls real file descriptors (without blocking) on every turn, and with no
timer pending it waits for them for real, so call_soon_threadsafe and sockets keep working.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Selector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):
        if timeout is None:  # nothing scheduled: wait for a real event
            return super().select(None)
        events = super().select(0)
        if not events and timeout > 0:
            self.now += timeout  # sleep in no time: straight to the next timer
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._vsel = _Selector()
        super().__init__(selector=self._vsel)

    def time(self) -> float:
        return self._vsel.now


def run(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro), on virtual time."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        tasks = asyncio.all_tasks(loop)  # a failed test's leftovers end here, not at exit
        for t in tasks:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
