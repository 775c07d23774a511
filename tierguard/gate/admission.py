"""The admission controller: bounded queues per class, a long-session limit, honest no.

Framework-free (plain asyncio) so the same object guards `tierguard gate` and
`tierguard serve`. Usage::

    controller = AdmissionController(policy)
    try:
        async with controller.admit(RequestInfo(input_tokens=n, priority="interactive",
                                                can_downgrade=is_chat)) as ticket:
            ...  # run the request; the slot is freed on exit, error or cancellation
    except Rejected as r:     # answer r.status (429, or 400 for oversize) + Retry-After
    except Downgrade as d:    # trim the input to <= d.max_input_tokens, retry with downgraded=True
    except HandOff as h:      # store the request as an async job, answer 202

Classes: a request is "long" when its input reaches `long_threshold`, otherwise its
priority names its class ("interactive" or "batch"). Slots are shared: at most
`max_concurrency` run at once, of which at most `max_long` are long. Each class has
its own FIFO queue of at most `max_queue` waiters, so a blocked long request never
blocks short ones. A waiter that would wait longer than `max_queue_wait_ms` is
rejected with 429 at that moment: nobody waits longer than the policy says.
When a slot frees, classes are served interactive, long, batch.

Async jobs (`RequestInfo.background=True`) wait without a deadline and outside the
`max_queue` bound (their number is bounded by the job runner's workers).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import count

from tierguard.gate.policy import PRIORITIES, AdmissionPolicy

CLASSES = ("interactive", "long", "batch")  # dispatch order when a slot frees


@dataclass
class RequestInfo:
    input_tokens: int
    priority: str = "interactive"
    can_downgrade: bool = False  # the caller can drop old chat turns (chat with >1 non-system turn)
    downgraded: bool = False  # already trimmed once; never downgrade twice
    background: bool = False  # an async job: no wait deadline, not bounded by max_queue
    key: str | None = None  # the same for a retry of the same request (predicted admission's bookings)


@dataclass
class Ticket:
    """An admitted request holding one slot until `release()`."""

    klass: str
    queue_wait_s: float
    admitted_at: float
    lease: str | None = None  # its lease id under shared limits (shared_admission.py)
    _released: bool = field(default=False, repr=False)

    def headers(self) -> dict[str, str]:
        """What the response tells the client about its admission (gate and serve alike)."""
        return {"X-Tierguard-Class": self.klass, "X-Tierguard-Queue-Ms": f"{self.queue_wait_s * 1000:.1f}"}


class AdmissionDecision(Exception):
    """Base of every refusal; `reason` is a short snake_case label counted in metrics."""

    decision = "reject"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Rejected(AdmissionDecision):
    decision = "reject"

    def __init__(self, reason: str, message: str, status: int = 429, retry_after_s: int | None = None) -> None:
        super().__init__(reason, message)
        self.status = status
        self.retry_after_s = retry_after_s


class Downgrade(AdmissionDecision):
    decision = "downgrade"

    def __init__(self, reason: str, message: str, max_input_tokens: int) -> None:
        super().__init__(reason, message)
        self.max_input_tokens = max_input_tokens


class HandOff(AdmissionDecision):
    decision = "async"


@dataclass
class _Waiter:
    future: asyncio.Future
    klass: str
    enqueued_at: float


@dataclass
class AdmissionStats:
    """A snapshot for /metrics and /health."""

    queued: dict[str, int]
    in_flight: dict[str, int]
    decisions: dict[tuple[str, str], int]  # (decision, reason) -> count


class AdmissionController:
    """Owns the slots and queues: the admission interface of `tierguard gate` and
    `tierguard serve` (`SharedAdmission` implements acquire, release, classify, record,
    retry_after_s, stats and check_integrity the same way, with fleet-wide limits).

    What a caller may assume: `acquire` returns a Ticket holding one slot or raises an
    AdmissionDecision (Rejected, Downgrade or HandOff), and counts the decision either
    way; a request waits at most `max_queue_wait_ms` (or `max_wait_s`, if shorter), except
    a background one, which waits without a deadline; a caller cancelled while it waits
    holds no slot. A slot is held until `release(ticket)`, which never blocks and may be
    called twice. At most `max_concurrency` slots are out at once, at most `max_long` of
    them long; a class is served in arrival order, and a freed slot goes to interactive,
    then long, then batch. Not thread-safe: use from one event loop.
    """

    def __init__(self, policy: AdmissionPolicy, on_decision: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy.validate()
        self._clock = clock  # queue waits and slot hold times (Retry-After's estimate) read it
        self._queues: dict[str, OrderedDict[int, _Waiter]] = {c: OrderedDict() for c in CLASSES}
        self._sync_queued = dict.fromkeys(CLASSES, 0)  # waiters counted against max_queue
        self._in_flight = dict.fromkeys(CLASSES, 0)
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._ids = count()
        self._service_ewma_s = 1.0  # mean time a slot is held; feeds Retry-After
        self._on_decision = on_decision

    # ---- public API -------------------------------------------------------------------
    def classify(self, info: RequestInfo) -> str:
        if info.input_tokens >= self.policy.long_threshold:
            return "long"
        return info.priority if info.priority in PRIORITIES else "interactive"

    @asynccontextmanager
    async def admit(self, info: RequestInfo) -> AsyncIterator[Ticket]:
        ticket = await self.acquire(info)
        try:
            yield ticket
        finally:
            self.release(ticket)

    async def acquire(self, info: RequestInfo, max_wait_s: float | None = None) -> Ticket:
        """Return a Ticket once a slot is granted, or raise an AdmissionDecision.

        `max_wait_s` shortens the queue deadline (a caller that already spent part of it)."""
        self.check_input(info)
        klass = self.classify(info)
        now = self._clock()
        if self._can_run(klass) and not self._queues[klass]:
            return self._grant(klass, 0.0, now, "admit", "free_slot")
        if not info.background and self._sync_queued[klass] >= self.policy.max_queue:
            self.overflow(info, klass)
        return await self._wait(info, klass, now, max_wait_s)

    def check_input(self, info: RequestInfo) -> None:
        """The input cap, before any slot: raises Downgrade (chat that can be trimmed) or Rejected (400)."""
        p = self.policy
        if p.max_input_tokens is not None and info.input_tokens > p.max_input_tokens:
            if info.can_downgrade and not info.downgraded:
                self.record("downgrade", "input_over_max")
                raise Downgrade("input_over_max", f"input of {info.input_tokens} tokens exceeds "
                                f"max_input_tokens={p.max_input_tokens}; trimming old turns",
                                p.max_input_tokens - p.downgrade_reserve_tokens)
            self.record("reject", "input_over_max")
            raise Rejected("input_over_max", f"input of {info.input_tokens} tokens exceeds the limit of "
                           f"{p.max_input_tokens} tokens", status=400)

    def adopt(self, klass: str, queue_wait_s: float, reason: str, lease: str | None = None) -> Ticket:
        """Count a slot granted elsewhere (a shared lease): in flight here, no local limit checked."""
        ticket = self._grant(klass, queue_wait_s, self._clock(), "admit", reason)
        ticket.lease = lease
        return ticket

    def release(self, ticket: Ticket) -> None:
        """Free the slot; idempotent. Hands the slot to the next waiter, if any."""
        if ticket._released:
            return
        ticket._released = True
        self._in_flight[ticket.klass] -= 1
        held = self._clock() - ticket.admitted_at
        self._service_ewma_s += 0.1 * (held - self._service_ewma_s)
        self._dispatch()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(queued={c: len(q) for c, q in self._queues.items()},
                              in_flight=dict(self._in_flight), decisions=dict(self._decisions))

    def retry_after_s(self, klass: str) -> int:
        """A hint, not a promise: time for the queue ahead to drain through the slots."""
        slots = self.policy.max_long if klass == "long" else self.policy.max_concurrency
        ahead = len(self._queues[klass]) + 1
        return int(min(60, max(1, math.ceil(self._service_ewma_s * ahead / slots))))

    def check_integrity(self) -> None:
        """In-flight counts stay within limits; raises RuntimeError when broken (tests call it)."""
        total = sum(self._in_flight.values())
        if total > self.policy.max_concurrency or self._in_flight["long"] > self.policy.max_long:
            raise RuntimeError(f"slot limits broken: {self._in_flight}")
        if min(self._in_flight.values()) < 0 or min(self._sync_queued.values()) < 0:
            raise RuntimeError(f"negative counters: {self._in_flight} {self._sync_queued}")

    # ---- internals --------------------------------------------------------------------
    def _can_run(self, klass: str) -> bool:
        if sum(self._in_flight.values()) >= self.policy.max_concurrency:
            return False
        return klass != "long" or self._in_flight["long"] < self.policy.max_long

    def _grant(self, klass: str, waited: float, now: float, decision: str, reason: str) -> Ticket:
        self._in_flight[klass] += 1
        self.record(decision, reason)
        return Ticket(klass=klass, queue_wait_s=waited, admitted_at=now)

    def overflow(self, info: RequestInfo, klass: str) -> None:
        """The class queue is full: raise what `policy.overflow` says (HandOff, Downgrade or Rejected)."""
        action = self.policy.overflow
        if action == "async":
            self.record("async", f"queue_full_{klass}")
            raise HandOff(f"queue_full_{klass}", f"the {klass} queue is full; running it as an async job")
        if action == "downgrade" and klass == "long" and info.can_downgrade and not info.downgraded:
            self.record("downgrade", "queue_full_long")
            raise Downgrade("queue_full_long", "long-session slots and queue are full; trimming old turns "
                            "to fit the short class", self.policy.long_threshold - 1 - self.policy.downgrade_reserve_tokens)
        self.record("reject", f"queue_full_{klass}")
        raise Rejected(f"queue_full_{klass}", f"the {klass} queue is full ({self.policy.max_queue} waiting); "
                       "retry later", retry_after_s=self.retry_after_s(klass))

    async def _wait(self, info: RequestInfo, klass: str, now: float, max_wait_s: float | None) -> Ticket:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), klass, now)
        key = next(self._ids)
        self._queues[klass][key] = waiter
        if not info.background:
            self._sync_queued[klass] += 1
        timeout = None if info.background else self.policy.max_queue_wait_ms / 1000.0
        if timeout is not None and max_wait_s is not None:
            timeout = max(0.0, min(timeout, max_wait_s))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(waiter.future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            granted = waiter.future.done() and not waiter.future.cancelled()
            if not granted:
                waiter.future.cancel()
                self._queues[klass].pop(key, None)
            if isinstance(exc, asyncio.CancelledError):
                if granted:  # the slot was handed over as the client left: give it back
                    self.release(waiter.future.result())
                self.record("cancel", "client_left_queue")
                raise
            if not granted:
                self.record("reject", f"queue_wait_{klass}")
                raise Rejected(f"queue_wait_{klass}", f"waited {self.policy.max_queue_wait_ms:.0f} ms in the "
                               f"{klass} queue without a slot", retry_after_s=self.retry_after_s(klass)) from None
        finally:
            if not info.background:
                self._sync_queued[klass] -= 1
        return waiter.future.result()

    def _dispatch(self) -> None:
        """Grant free slots to waiters in class order; FIFO within a class."""
        progressed = True
        while progressed:
            progressed = False
            for klass in CLASSES:
                queue = self._queues[klass]
                while queue and self._can_run(klass):
                    _, waiter = queue.popitem(last=False)
                    if waiter.future.done():
                        continue  # timed out or cancelled; already counted
                    now = self._clock()
                    waiter.future.set_result(self._grant(klass, now - waiter.enqueued_at, now, "admit", "queued"))
                    progressed = True

    def record(self, decision: str, reason: str) -> None:
        """Count a decision; callers use it for decisions they take themselves (e.g. a failed trim)."""
        self._decisions[(decision, reason)] += 1
        if self._on_decision is not None:
            self._on_decision(decision, reason)
