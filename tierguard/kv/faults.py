"""Fault injection for tests: make the next N operations of a kind fail or stall.

Tiers and the transfer worker call `check(op)` at the points where real I/O can fail;
tests arm a rule (`fail("disk.write", errno.ENOSPC)`) and observe that the failure ends
as a counted miss, never as an exception reaching the caller; or a delay
(`delay("disk.read", 0.3)`) to play a slow device against the staging deadline. An
engine takes its injector at construction (`LLMEngine(..., faults=...)`).

Operation names: "disk.write", "disk.read", "transfer".
"""

from __future__ import annotations

import errno
import os
import threading
import time


class FaultInjector:
    def __init__(self) -> None:
        self._rules: dict[str, list[int]] = {}  # op -> errnos still to raise, in order
        self._delays: dict[str, list[float]] = {}  # op -> seconds still to sleep, in order
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {}

    def fail(self, op: str, err: int = errno.EIO, times: int = 1) -> None:
        """Make the next `times` calls of `check(op)` raise OSError(err)."""
        with self._lock:
            self._rules.setdefault(op, []).extend([err] * times)

    def delay(self, op: str, seconds: float, times: int = 1) -> None:
        """Make the next `times` calls of `check(op)` sleep `seconds` first (a slow device)."""
        with self._lock:
            self._delays.setdefault(op, []).extend([seconds] * times)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._delays.clear()

    def check(self, op: str) -> None:
        with self._lock:
            delays = self._delays.get(op)
            pause = delays.pop(0) if delays else 0.0
        if pause:
            time.sleep(pause)
        with self._lock:
            pending = self._rules.get(op)
            if not pending:
                return
            err = pending.pop(0)
            self.fired[op] = self.fired.get(op, 0) + 1
        raise OSError(err, f"injected: {os.strerror(err)}")
