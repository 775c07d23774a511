"""Is the client itself distorting the measurement?

A Python client that falls behind stamps chunks late and sends requests late, and the
numbers it reports drift away from what the server did. Three signals are measured
during every run: send lateness (actual dispatch vs schedule), event-loop lag (a ticker
that should wake every 10 ms measures how late it wakes), and client CPU use. Beyond the
configured thresholds the run is flagged `client_distorted` with the reasons.
"""

from __future__ import annotations

import asyncio
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from tierguard.common.percentile import percentile


class LoopLagMonitor:
    """Samples how late the event loop runs a 10 ms timer; start/stop inside the loop."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval = interval_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            due = time.monotonic() + self.interval
            await asyncio.sleep(self.interval)
            self.lags_ms.append(max(0.0, (time.monotonic() - due) * 1000.0))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


def cpu_seconds() -> float:
    """User + system CPU of this process (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclass
class WorkerHealth:
    """What one client process measured about itself."""

    worker: int
    cpu_s: float
    wall_s: float
    loop_lag_ms: list[float] = field(default_factory=list)

    @property
    def cpu_util(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def assess(healths: list[WorkerHealth], lateness_ms: list[float], n_requests: int, max_lateness_ms: float,
           max_lag_ms: float, max_cpu_util: float, parent_cpu_s: float = 0.0) -> dict:
    """Summarize the self-check and decide whether the run is distorted."""
    lags = np.asarray([x for h in healths for x in h.loop_lag_ms] or [0.0])
    late = np.asarray(lateness_ms or [0.0])
    cpu = sum(h.cpu_s for h in healths) + parent_cpu_s
    out = {
        "p99_send_lateness_ms": percentile(late, 99),
        "max_send_lateness_ms": float(late.max()),
        "p99_loop_lag_ms": percentile(lags, 99),
        "max_loop_lag_ms": float(lags.max()),
        "client_cpu_s": cpu,
        "client_cpu_ms_per_request": cpu * 1000.0 / n_requests if n_requests else None,
        "client_cpu_util_max": max((h.cpu_util for h in healths), default=0.0),
        "workers": len(healths),
    }
    reasons = []
    if out["p99_send_lateness_ms"] > max_lateness_ms:
        reasons.append(f"p99 send lateness {out['p99_send_lateness_ms']:.1f} ms > {max_lateness_ms:g} ms")
    if out["p99_loop_lag_ms"] > max_lag_ms:
        reasons.append(f"p99 event-loop lag {out['p99_loop_lag_ms']:.1f} ms > {max_lag_ms:g} ms")
    if out["client_cpu_util_max"] > max_cpu_util:
        reasons.append(f"a client process used {out['client_cpu_util_max']:.0%} of a core (> {max_cpu_util:.0%}); "
                       "try --workers")
    out["client_distorted"] = bool(reasons)
    out["distortion_reasons"] = reasons
    return out
