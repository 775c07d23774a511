"""Fault injection into a running vLLM connector, for tests and benchmarks only.

A vLLM server is a separate process tree, so a test cannot call `FaultInjector.delay()` on
it. With `fault_file` set in the connector's extra config, a watcher thread re-reads that
JSON file whenever it changes and arms the scheduler side's injector (the one its media
and transfer worker consult, tierguard/kv/faults.py):

    [{"op": "disk.read", "delay_s": 30, "times": 1},
     {"op": "disk.read", "errno": 5, "times": 2}]

An empty list clears every rule. A file that does not parse arms nothing and is logged.
The watcher does no work on vLLM's threads. Off unless configured; never set in production.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading

from tierguard.kv.faults import FaultInjector

log = logging.getLogger("tierguard.integrations.vllm")
POLL_S = 0.1


def arm(faults: FaultInjector, rules: list[dict]) -> None:
    """Replace the armed rules with `rules` (see the module docstring)."""
    faults.clear()
    for rule in rules:
        op, times = str(rule["op"]), int(rule.get("times", 1))
        if "delay_s" in rule:
            faults.delay(op, float(rule["delay_s"]), times)
        if "errno" in rule:
            faults.fail(op, int(rule.get("errno") or errno.EIO), times)


class FaultFileWatcher:
    def __init__(self, path: str, faults: FaultInjector, poll_s: float = POLL_S) -> None:
        self.path = path
        self.faults = faults
        self.poll_s = poll_s
        self._seen: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-fault-file", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.poll_s)

    def check(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._seen:
            return
        self._seen = stamp
        try:
            with open(self.path) as f:
                rules = json.load(f)
            arm(self.faults, list(rules))
            log.warning("tierguard connector: fault rules armed from %s: %s", self.path, rules)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("tierguard connector: fault file %s ignored: %s", self.path, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
