"""Admission with limits shared by every gate on one Redis (`--shared-state redis://...`).

The same interface as `AdmissionController` (acquire / release / classify / stats), so
the proxy and the job runner do not know which one they hold. `--max-concurrency`,
`--max-long` and the per-class queue bound are fleet-wide: a slot is a lease in Redis
(`leases.py`) and a waiter a place in a fleet-wide queue. The local controller still
counts this gate's own requests (for /metrics) and is the fallback.

Redis unreachable (a refused or broken connection at once; answers slower than
`--shared-timeout-ms` three times in a row over at least three timeouts, so one slow
answer on a busy host is not an outage, nor is one stall that fails many concurrent calls
at once): the gate falls back to local limits, a SHARE of the fleet's: each limit divided
by the number of gates last seen alive in Redis (at least `--shared-gates`), so N gates
that all lose Redis still send the upstream about the fleet limit, and nothing fails or
hangs because Redis went away. Waiters in the shared queue move to the local queue within
what is left of their wait. Every fallback admission is counted (`tierguard_gate_shared_
fallback_admissions_total`), the state is on /metrics and /health. The renewal loop probes
Redis every lease/3; when it answers, the leases of everything still running (admitted
locally meanwhile included) are written back, and shared admission resumes.

What the fallback cannot promise: at the moment Redis goes away one gate may hold more
than its share (it took them fairly from the shared pool); the others do not know, so
until those requests end the fleet may run up to that imbalance above the limit.

Why fall back rather than fail closed: Redis would otherwise be a single point whose
failure refuses every request of the fleet; a local share keeps the upstream's load
bounded by about the same number, which is what the limit is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from redis.exceptions import RedisClusterException, RedisError

from tierguard.gate.admission import AdmissionController, AdmissionStats, Rejected, RequestInfo, Ticket
from tierguard.gate.leases import QUEUES, LeaseStore, SharedDown
from tierguard.gate.policy import AdmissionPolicy

log = logging.getLogger("tierguard.gate")
QUEUE_OF = {"interactive": 0, "long": 1, "batch": 2}
SLOW_STRIKES = 3  # slow Redis answers in a row that count as Redis down (a refusal counts at once)
RECOVERY_PROBE_S = 0.5  # while Redis is down, it is probed at least this often
ASYNC_QUEUE = 3


@dataclass
class _Waiter:
    future: asyncio.Future
    klass: str
    queue: int
    lease: str
    enqueued_at: float
    place: int  # arrival number in the fleet-wide queue: local waiters are asked in this order


@dataclass
class SharedCounters:
    """Cumulative, for /metrics."""

    waits: int = 0  # requests that waited in the shared queue
    lease_expiries: int = 0  # expired leases this gate reaped (their holder stopped renewing: died or stalled)
    readded: int = 0  # this gate's leases found gone at renewal and written back
    fallback_admissions: int = 0  # admitted by the local share while Redis was unreachable
    errors: int = 0  # Redis calls that failed or timed out
    failovers: int = 0  # the fleet's slot found on another node while calls succeeded (taken as an outage)
    live_gates: int = 1


class SharedAdmission:
    """AdmissionController's interface and contract over leases in Redis, the limits
    fleet-wide (within what the fallback cannot promise: module docstring); one event
    loop, not thread-safe."""

    def __init__(self, policy: AdmissionPolicy, store: LeaseStore, *, min_gates: int = 1) -> None:
        self.policy = policy.validate()
        self.local = AdmissionController(replace(policy))
        self.store = store
        self.min_gates = min_gates
        self.up = False  # until the first renewal answers
        self._strikes = 0  # failed Redis calls in a row
        self._first_strike = 0.0  # time.monotonic() of the first of them
        self._reached = False  # start() made its first call: later recoveries are logged
        self._expiry_due = math.inf  # time.monotonic() when the oldest known slot lease expires
        self._down_since: float | None = None  # time.monotonic() when an outage after shared admission began
        self._settle_until: float | None = None  # when Redis answers again: the local share until then
        self._moves_seen = 0  # store.moves already handled
        self.counters = SharedCounters()
        self._waiters: list[OrderedDict[str, _Waiter]] = [OrderedDict() for _ in QUEUES]
        self._held: dict[str, bool] = {}  # lease -> is long; every slot this gate holds
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._closing = False  # the loops end at their next turn (a lost cancellation included)
        self._background: set[asyncio.Task] = set()
        self.poll_s = min(0.1, store.lease_ms / 10000)  # backstop for wake-ups pub/sub cannot give (expiry)
        self._set_share(min_gates)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """First contact (bounded by the store's timeout), then the renewal, wake-up and dispatch tasks."""
        await self._renew_once()
        self._reached = True
        if not self.up:
            log.warning("shared state %s unreachable at start: admitting within the local share "
                        "(max_concurrency %d, max_long %d) until it answers", self.store.url,
                        self.local.policy.max_concurrency, self.local.policy.max_long)
        self._tasks = [asyncio.create_task(self._renew_loop()), asyncio.create_task(self._listen()),
                       asyncio.create_task(self._dispatch_loop()), asyncio.create_task(self._touch_loop())]

    async def close(self) -> None:
        # A cancellation can be lost when a timeout inside the task fires at the same moment
        # (Python 3.11's asyncio.timeout turns it into a TimeoutError, which the loops catch):
        # the loops also stop on `_closing`, and a task still running is cancelled again.
        self._closing = True
        pending = set(self._tasks)
        while pending:
            for t in pending:
                t.cancel()
            _done, pending = await asyncio.wait(pending, timeout=1.0)
        if self._background:  # releases under way: give them a moment, then the leases expire anyway
            await asyncio.wait(list(self._background), timeout=1.0)
        await self.store.close()

    # ---- the AdmissionController interface ---------------------------------------------
    def classify(self, info: RequestInfo) -> str:
        return self.local.classify(info)

    def record(self, decision: str, reason: str) -> None:
        self.local.record(decision, reason)

    def retry_after_s(self, klass: str) -> int:
        return self.local.retry_after_s(klass)

    def stats(self) -> AdmissionStats:
        s = self.local.stats()
        for q, waiters in enumerate(self._waiters):
            klass = QUEUES[q] if q != ASYNC_QUEUE else "batch"
            s.queued[klass] = s.queued.get(klass, 0) + len(waiters)
        return s

    async def acquire(self, info: RequestInfo, max_wait_s: float | None = None) -> Ticket:
        self.local.check_input(info)
        klass = self.local.classify(info)
        if not self.up:
            return await self._local(info, max_wait_s)
        p = self.policy
        queue = ASYNC_QUEUE if info.background else QUEUE_OF[klass]
        t0 = time.monotonic()
        while True:
            # A fresh id per try: a try that timed out may still have been applied; its lease or
            # place then expires unused (the fleet runs below its limit for that while, never above).
            lease = self.store.new_id()
            try:
                r = await self.store.acquire(queue, klass == "long", lease, queued=False,
                                             max_concurrency=p.max_concurrency, max_long=p.max_long,
                                             max_queue=0 if info.background else p.max_queue)
                break
            except SharedDown as exc:
                if self._failed(exc):
                    return await self._local(info, max_wait_s)
        self._ok()
        self.counters.lease_expiries += r.reaped
        if r.granted:
            return self._adopt(klass, lease, 0.0, "free_slot")
        if r.status == 2:
            self.local.overflow(info, klass)  # raises: HandOff, Downgrade or Rejected, counted
        if r.next_expiry_ms >= 0:
            self._expiry_due = min(self._expiry_due, time.monotonic() + r.next_expiry_ms / 1000 + 0.002)
        return await self._wait(info, klass, queue, lease, t0, r.place, max_wait_s)

    def release(self, ticket: Ticket) -> None:
        """Free the slot here at once and in Redis in the background (publishing a wake-up)."""
        if ticket._released:
            return
        self.local.release(ticket)
        if ticket.lease is not None and self._held.pop(ticket.lease, None) is not None and self.up:
            self._spawn(self._free(ticket.lease))

    def check_integrity(self) -> None:
        total = sum(self.local.stats().in_flight.values())
        if total != len(self._held):
            raise RuntimeError(f"{total} slots in flight but {len(self._held)} leases held")

    # ---- waiting -----------------------------------------------------------------------
    async def _wait(self, info: RequestInfo, klass: str, queue: int, lease: str, t0: float, place: int,
                    max_wait_s: float | None) -> Ticket:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[queue][lease] = _Waiter(fut, klass, queue, lease, t0, place)
        self.counters.waits += 1
        self._kick.set()
        timeout = None if info.background else self.policy.max_queue_wait_ms / 1000.0
        if timeout is not None and max_wait_s is not None:
            timeout = max(0.0, min(timeout, max_wait_s))
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except SharedDown:  # Redis failed while this request waited: the local share, in the time left
            left = None if timeout is None else timeout - (time.monotonic() - t0)
            return await self._local(info, left)
        except (TimeoutError, asyncio.CancelledError) as exc:
            granted = fut.done() and not fut.cancelled() and fut.exception() is None
            if not granted:
                fut.cancel()
                self._spawn(self._free(lease))  # leave the fleet-wide queue
            if isinstance(exc, asyncio.CancelledError):
                if granted:
                    self.release(fut.result())
                self.local.record("cancel", "client_left_queue")
                raise
            if granted:
                return fut.result()
            self.local.record("reject", f"queue_wait_{klass}")
            raise Rejected(f"queue_wait_{klass}", f"waited {timeout * 1000:.0f} ms in the fleet-wide {klass} "
                           "queue without a slot", retry_after_s=self.local.retry_after_s(klass)) from None
        finally:
            self._waiters[queue].pop(lease, None)

    async def _dispatch_loop(self) -> None:
        """Ask Redis, head of each local queue first, whether it is their turn; after a wake-up
        (a slot freed anywhere) or every poll_s (a lease expired: nobody publishes that)."""
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.001, min(self.poll_s, self._expiry_due - time.monotonic()))):
                    await self._kick.wait()
            self._kick.clear()
            self._expiry_due = math.inf
            if not self.up:
                self._fail_waiters(SharedDown("shared state unreachable"))
                continue
            try:
                if await self._dispatch():  # only an answer clears the strikes: a pass with no
                    self._ok()  # waiters asks nothing, and a hung Redis went unnoticed behind it
            except SharedDown as exc:
                self._failed(exc)  # still up after a slow answer: the next pass asks again

    async def _dispatch(self) -> bool:
        """Returns whether Redis was asked (and answered)."""
        p = self.policy
        asked = False
        for queue in self._waiters:
            # Concurrent arrivals join Redis in an order their replies need not keep: ask in Redis's order,
            # or the first in line may never be asked while the ones behind it wait for it.
            for w in sorted(queue.values(), key=lambda w: w.place):
                lease = w.lease
                if w.future.done():
                    continue
                r = await self.store.acquire(w.queue, w.klass == "long", lease, queued=True,
                                             max_concurrency=p.max_concurrency, max_long=p.max_long, max_queue=0)
                asked = True
                if r.status == -1 and not w.future.done():
                    # its place expired (this gate stalled past a lease time): back in line
                    r = await self.store.acquire(w.queue, w.klass == "long", lease, queued=False,
                                                 max_concurrency=p.max_concurrency, max_long=p.max_long,
                                                 max_queue=0)
                self.counters.lease_expiries += r.reaped
                if r.place:
                    w.place = r.place
                if w.future.done():  # it gave up while Redis answered: give back what it got
                    if r.status in (0, 1):
                        self._spawn(self._free(lease))
                    continue
                if not r.granted:
                    if r.next_expiry_ms >= 0:  # ask again the moment the oldest lease would expire
                        self._expiry_due = min(self._expiry_due, time.monotonic() + r.next_expiry_ms / 1000 + 0.002)
                    break  # FIFO: the ones behind it are not first either
                w.future.set_result(self._adopt(w.klass, lease, time.monotonic() - w.enqueued_at, "queued"))
        return asked

    # ---- local share -------------------------------------------------------------------
    async def _local(self, info: RequestInfo, max_wait_s: float | None) -> Ticket:
        t0 = time.monotonic()
        ticket = await self.local.acquire(info, max_wait_s)
        if self.up:
            # Redis came back while it waited here: a local slot is not a fleet slot (Redis would
            # not know of it until the next renewal, and grant it to someone else meanwhile).
            self.local.release(ticket)
            left = None if max_wait_s is None else max(0.0, max_wait_s - (time.monotonic() - t0))
            if left is None and not info.background:
                left = max(0.0, self.policy.max_queue_wait_ms / 1000 - (time.monotonic() - t0))
            return await self.acquire(info, left)
        self.counters.fallback_admissions += 1
        # A lease id for it too: the first renewal after Redis returns writes it there, so the
        # fleet sees what really runs.
        ticket.lease = self.store.new_id()
        self._held[ticket.lease] = ticket.klass == "long"
        return ticket

    def _adopt(self, klass: str, lease: str, waited: float, reason: str) -> Ticket:
        self._held[lease] = klass == "long"
        return self.local.adopt(klass, waited, reason, lease)

    def _set_share(self, live_gates: int) -> None:
        n = max(1, live_gates, self.min_gates)
        self.counters.live_gates = live_gates
        self.local.policy.max_concurrency = max(1, self.policy.max_concurrency // n)
        self.local.policy.max_long = max(1, min(self.local.policy.max_concurrency, self.policy.max_long // n))

    # ---- Redis state -------------------------------------------------------------------
    def _failed(self, exc: SharedDown) -> bool:
        """Count a failed call; True when Redis is now taken as down: refused (nothing listens),
        or SLOW_STRIKES slow answers in a row that span SLOW_STRIKES timeouts. One slow answer
        on a busy host is not an outage, and neither is one stall: it fails every call in
        flight at the same moment (seen on CI: 3 strikes within one timeout, a fallback to the
        local share while the other gate held the fleet's slots, 4 running of 3)."""
        self.counters.errors += 1
        now = time.monotonic()
        if self._strikes == 0:
            self._first_strike = now
        self._strikes += 1
        stalled = now - self._first_strike >= (SLOW_STRIKES - 1) * self.store.timeout_s
        if exc.refused or (self._strikes >= SLOW_STRIKES and stalled) or not self.up:
            self._down(exc)
            return True
        return False

    def _ok(self) -> None:
        self._strikes = 0
        if self.store.moves != self._moves_seen:  # a failover, though this gate's calls never failed
            self._moves_seen = self.store.moves
            self.counters.failovers += 1
            self._down(SharedDown(f"the fleet's slot is served by another node now ({self.store.master}); "
                                  "the old master's last writes may be lost"))

    def _down(self, exc: Exception) -> None:
        if self.up:
            self.up = False
            self._down_since = time.monotonic()
            log.warning("shared state %s unreachable (%s): admitting within the local share "
                        "(max_concurrency %d, max_long %d) until it answers", self.store.url, exc,
                        self.local.policy.max_concurrency, self.local.policy.max_long)
        self._fail_waiters(exc if isinstance(exc, SharedDown) else SharedDown(str(exc)))

    def _fail_waiters(self, exc: SharedDown) -> None:
        for queue in self._waiters:
            for w in queue.values():
                if not w.future.done():
                    w.future.set_exception(exc)

    async def _renew_once(self) -> None:
        """Renew every held lease. While Redis is down this is also the probe; shared admission
        resumes only after a renewal that wrote back every slot running here: a local grant made
        while the call was under way is in the next round, before anyone counts on Redis again."""
        recovering = not self.up
        if recovering and self._settle_until is None:
            await self.store.reset()  # nothing else uses Redis while it is down: start clean
        written: set[str] = set()
        for _ in range(4 if recovering else 1):
            held = dict(self._held)
            try:
                r = await self.store.renew(list(held.items()))
            except SharedDown as exc:
                self._failed(exc)
                self._settle_until = None  # down again: the settling starts over at the next answer
                return
            self._ok()
            written |= held.keys()
            self.counters.lease_expiries += r.reaped
            self.counters.readded += r.readded
            # Out of shared admission, the share never grows: a new master may not yet hold
            # every live gate's heartbeat (they write theirs back on their own next call).
            self._set_share(max(r.live_gates, self.counters.live_gates) if recovering else r.live_gates)
            if self._held.keys() <= written:
                break
        else:
            return  # local grants kept coming during every round: try again next period
        if recovering:
            for lease in written - self._held.keys():  # ended while the call was under way
                self._spawn(self._free(lease))
            if self._down_since is not None and not self._settled():
                return
            self._down_since = None
            self.up = True
            if not self._reached:  # the first call, from start(): GateState.create says it
                return
            log.warning("shared state %s answers: fleet-wide limits (%d live gates; the leases of %d running "
                        "requests written back)", self.store.url, r.live_gates, len(written & self._held.keys()))
            self._kick.set()

    def _settled(self) -> bool:
        """After an outage (a failover included), shared admission resumes only once every
        other live gate has written its leases back too, so that Redis counts what really
        runs: each gate calls Redis at least every renewal period, so its first call after the
        outage began failed by `_down_since` + one renewal period at the latest (the outage
        began before this gate noticed it), and its next probe, one probe period later, wrote
        its leases back if Redis answered by then. Until that moment this gate stays on its
        local share (docs/fleet.md: the bound during a failover)."""
        now = time.monotonic()
        if self._settle_until is None:
            renew = self.store.lease_ms / 3000
            probe = min(renew, RECOVERY_PROBE_S)
            self._settle_until = max(now, self._down_since + renew) + probe + 2 * self.store.timeout_s
        if now < self._settle_until:
            return False
        self._settle_until = None
        return True

    async def _renew_loop(self) -> None:
        period = self.store.lease_ms / 3000
        while not self._closing:
            await asyncio.sleep(period if self.up else min(period, RECOVERY_PROBE_S))
            await self._renew_once()

    async def _touch_loop(self) -> None:
        """Keep this gate's queue places (they expire sooner than slots: `leases.py`)."""
        while not self._closing:
            await asyncio.sleep(self.store.waiter_ms / 3000)
            waiters = [lease for queue in self._waiters for lease in queue]
            if not waiters or not self.up:
                continue
            try:
                await self.store.touch(waiters)  # a lost place is retaken by the dispatcher (status -1)
            except SharedDown as exc:
                self._failed(exc)

    async def _listen(self) -> None:
        """Wake the dispatcher when any gate frees a slot (pub/sub); reconnects after a failure."""
        while not self._closing:
            pubsub = None
            try:
                async with asyncio.timeout(self.store.timeout_s * 5):
                    pubsub = await self.store.subscriber()
                    await pubsub.subscribe(self.store.channel)
                while not self._closing:
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0) is not None:
                        self._kick.set()
            except (RedisError, RedisClusterException, OSError, TimeoutError, KeyError):
                await asyncio.sleep(0.5)  # KeyError: a cluster slot map read while the cluster changed
            finally:
                with contextlib.suppress(RedisError, RedisClusterException, OSError, TimeoutError, RuntimeError):
                    if pubsub is not None:
                        async with asyncio.timeout(self.store.timeout_s * 5):
                            await pubsub.aclose()

    async def _free(self, lease: str) -> None:
        try:
            await self.store.release(lease)
        except SharedDown as exc:
            self._failed(exc)  # the lease expires by itself
        self._kick.set()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
