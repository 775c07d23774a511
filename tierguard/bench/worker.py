"""One client process: dispatch its share of the schedule and stream the requests.

Open loop: each request is dispatched at t0 + its scheduled offset, then waits for a
concurrency slot (the wait is recorded), then is sent. Closed loop (rate inf with a
limit): a request is due the moment a slot opens. Request state moves
queued → in progress → ok | failed | timeout | rejected | cancelled, and `try/finally`
guarantees every record ends in one of the final states even on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierguard.bench.backend import OpenAIBackend, Quirks, open_client
from tierguard.bench.datasets import RequestSpec
from tierguard.bench.records import CANCELLED, RequestRecord
from tierguard.bench.selfcheck import LoopLagMonitor, WorkerHealth, cpu_seconds
from tierguard.bench.strategy import ConcurrencyLimiter


@dataclass
class WorkerPlan:
    """Everything a worker needs; picklable so it can cross a process boundary."""

    worker: int
    n_workers: int
    base_url: str
    endpoint: str
    model: str
    api_key: str | None
    ignore_eos: bool
    temperature: float
    timeout_s: float
    quirks: Quirks
    specs: list[RequestSpec]
    offsets: list[float]  # scheduled offsets (s) aligned with specs; unused in closed loop
    concurrency: int | None
    closed_loop: bool
    duration_s: float | None = None  # closed loop: keep cycling specs until then
    max_requests: int | None = None  # closed loop without duration: stop after this many
    preconnect: int = 0  # keep-alive connections opened before the clock starts
    http_client: str = "auto"


@dataclass
class WorkerOutput:
    records: list[RequestRecord] = field(default_factory=list)
    health: WorkerHealth | None = None
    quirks: Quirks | None = None
    t0: float = 0.0  # CLOCK_MONOTONIC of the run's start; record times are relative to it
    preconnected: int = 0
    worker_error: str | None = None  # a worker process that crashed (its records are lost)


def _new_record(plan: WorkerPlan, spec: RequestSpec, k: int, scheduled: float, dispatched: float) -> RequestRecord:
    return RequestRecord(index=spec.index if not plan.closed_loop else plan.worker + k * plan.n_workers,
                         worker=plan.worker, input_len=spec.input_len, output_len_requested=spec.output_len,
                         group=spec.group, scheduled_s=scheduled, dispatched_s=dispatched)


async def run_worker(plan: WorkerPlan, start_at: Callable[[], float], should_stop: Callable[[], bool],
                     on_done: Callable[[RequestRecord], None] | None = None) -> WorkerOutput:
    """Run this worker's share. `start_at()` is called once the worker is ready (connections
    open) and returns t0, the CLOCK_MONOTONIC instant every offset is relative to."""
    backend = OpenAIBackend(plan.endpoint, plan.model, plan.api_key, plan.ignore_eos, plan.temperature,
                            plan.timeout_s, plan.quirks)
    limiter = ConcurrencyLimiter(plan.concurrency)
    lag = LoopLagMonitor()
    out = WorkerOutput(quirks=backend.quirks)
    mono = time.monotonic
    tasks: set[asyncio.Task] = set()
    t0 = 0.0

    async def one(spec: RequestSpec, rec: RequestRecord, holds_slot: bool) -> None:
        try:
            if not holds_slot:
                await limiter.acquire()
                holds_slot = True
                rec.slot_s = mono() - t0
            else:
                rec.slot_s = rec.dispatched_s  # closed loop: the dispatcher took the slot
            await backend.send(client, spec.prompt, spec.output_len, rec, t0)
        except asyncio.CancelledError:
            rec.status, rec.error = CANCELLED, "cancelled before completion"
            rec.end_s = mono() - t0
        finally:
            if holds_slot:
                limiter.release()
            if on_done is not None:
                on_done(rec)

    def spawn(spec: RequestSpec, rec: RequestRecord, holds_slot: bool) -> None:
        out.records.append(rec)
        task = asyncio.get_running_loop().create_task(one(spec, rec, holds_slot))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async with contextlib.AsyncExitStack() as stack:
        client = await open_client(stack, plan.base_url, plan.http_client)
        if plan.preconnect:
            # Open connections before t0 so TCP set-up is not inside the first wave's TTFT
            # (a connection opened later is still timed: `connect_ms`).
            out.preconnected = await client.preconnect(plan.preconnect)
        t0 = out.t0 = start_at()
        # A full GC pass over thousands of live records stalls the loop for tens of ms,
        # stamping late every chunk that arrives meanwhile: no automatic GC while timing.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        stack.callback(lambda: gc.enable() if gc_was_enabled else None)
        cpu0 = cpu_seconds()
        lag.start()
        try:
            if plan.closed_loop:
                k = 0
                while plan.specs and not should_stop():
                    if plan.max_requests is not None and k >= plan.max_requests:
                        break
                    await limiter.acquire()
                    now = mono() - t0
                    if (plan.duration_s is not None and now >= plan.duration_s) or should_stop():
                        limiter.release()
                        break
                    spec = plan.specs[k % len(plan.specs)]
                    spawn(spec, _new_record(plan, spec, k, now, now), True)
                    k += 1
            else:
                for k, (spec, off) in enumerate(zip(plan.specs, plan.offsets, strict=True)):
                    while (delay := t0 + off - mono()) > 0 and not should_stop():
                        await asyncio.sleep(min(delay, 0.25))
                    if should_stop():
                        break
                    spawn(spec, _new_record(plan, spec, k, off, mono() - t0), False)
            while tasks:
                if should_stop():
                    for t in list(tasks):
                        t.cancel()
                await asyncio.wait(set(tasks), timeout=0.25)
        finally:
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.wait(set(tasks), timeout=5)
            await lag.stop()
    out.health = WorkerHealth(plan.worker, cpu_seconds() - cpu0, mono() - t0, lag.lags_ms)
    return out


def run_async(coro):
    """Run `coro` on uvloop when installed (about half the per-chunk client cost)."""
    try:
        import uvloop  # type: ignore
    except ImportError:
        return asyncio.run(coro)
    if hasattr(asyncio, "Runner"):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    uvloop.install()  # Python 3.10
    return asyncio.run(coro)


def loop_name() -> str:
    try:
        import uvloop  # type: ignore  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"
