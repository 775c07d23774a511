"""Predicted-TTFT admission (`--admission predicted`): yes when the TTFT a request would see
is within its class's SLO, otherwise an answer at once.

Per arrival and upstream (O(the gate's queue) arithmetic, `ttft_upstream.py`): the prefill
work that would go before it there, its own prompt and the running decodes, priced by the
closed form (`ttft_model.py`). The upstream with the lowest prediction is chosen; the
request is admitted when the prediction plus `Z` spreads of the fit's relative error is
within the SLO of its class. Otherwise `--overflow` says what happens: reject (429 with
`Retry-After` = the predicted wait, the time the work ahead of it needs), downgrade (the
chat trimmed to what fits) or async (202).

Admitted requests wait in the gate, per upstream, and are sent while the upstream's
unfinished prefill is under one step's budget (C - D tokens), so the engine always has a
step's work and the gate keeps the order: interactive first, batch in what is left, async
jobs last, FIFO within a class. Nothing starves: a request that has waited its budget
(its SLO less its own service and one step) goes before every request that has not, in
the order their budgets ran out, so it is never overtaken.

A rejected client is told when to come back and its place is kept (`ttft_bookings.py`):
its retry takes the place it had, so a client that waits as told finds room.

The same interface as `AdmissionController` (acquire, release, classify, record, stats,
check_input, check_integrity). One event loop, not thread-safe.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tierguard.gate.admission import (
    AdmissionController,
    AdmissionStats,
    Downgrade,
    HandOff,
    Rejected,
    RequestInfo,
    Ticket,
)
from tierguard.gate.policy import AdmissionPolicy
from tierguard.gate.ttft_bookings import Bookings
from tierguard.gate.ttft_model import FLOOR_S, OnlineFit, keys_of
from tierguard.gate.ttft_options import PredictedOptions
from tierguard.gate.ttft_upstream import Entry, Sent, UpstreamWork

RANKS = {"interactive": 0, "batch": 1}
JOB_RANK = 2
Z = 2.0  # admitted when prediction + Z x spread is within the SLO
MIN_TRIM_TOKENS = 16
HOLD_S = 2.0  # bookings due back within this long may hold the waiters behind them  # a trim that leaves less is no answer


@dataclass
class PredictedTicket(Ticket):
    replica: int = 0
    seq: int = 0
    predicted_s: float = 0.0  # TTFT from arrival, predicted at admission
    _owner: PredictedAdmission | None = field(default=None, repr=False)

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "X-Tierguard-Predicted-TTFT-Ms": f"{self.predicted_s * 1000:.1f}"}

    def first_byte(self, at: float) -> None:
        """The upstream's first byte for this request reached the gate at `at` (monotonic)."""
        if self._owner is not None:
            self._owner.first_byte(self, at)


class PredictedAdmission:
    """See the module docstring. `healthy(index)` (from `attach`) says which upstreams may
    take new requests; `clock` is time.monotonic unless a test pins it."""

    prices_tokens = True  # the proxy counts every prompt: its size is the prediction's input

    def __init__(self, policy: AdmissionPolicy, options: PredictedOptions, urls: list[str],
                 clock: Callable[[], float] = time.monotonic, shared=None) -> None:
        self.policy = replace(policy).validate()
        self.options = options
        self.clock = clock
        self.upstreams = [UpstreamWork(i, url, OnlineFit(p, options.window, options.online))
                          for i, (url, p) in enumerate(zip(urls, options.priors, strict=True))]
        self.shared = shared
        self._healthy: Callable[[int], bool] = lambda _i: True
        self._seq = 0
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._in_flight = {"interactive": 0, "batch": 0}
        self._waiting = {"interactive": 0, "batch": 0}
        self.bookings = Bookings()

    # ---- lifecycle ---------------------------------------------------------------------
    def attach(self, healthy: Callable[[int], bool]) -> None:
        self._healthy = healthy

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.start(self)

    async def close(self) -> None:
        for u in self.upstreams:
            if u.wake is not None:
                u.wake.cancel()
        if self.shared is not None:
            await self.shared.close()

    # ---- the AdmissionController interface ---------------------------------------------
    def classify(self, info: RequestInfo) -> str:
        return info.priority if info.priority in RANKS else "interactive"

    def record(self, decision: str, reason: str) -> None:
        self._decisions[(decision, reason)] += 1

    def check_input(self, info: RequestInfo) -> None:
        AdmissionController.check_input(self, info)  # type: ignore[arg-type]  # the same cap, the same answers

    def retry_after_s(self, klass: str) -> int:
        """Seconds until the work ahead of a new request of `klass` is done, at the least loaded upstream."""
        now = self.clock()
        waits = [u.predict(*u.ahead(now, RANKS.get(klass, 0), self.bookings.show_share))[0] for u in self.upstreams]
        return max(1, math.ceil(min(waits)))

    def stats(self) -> AdmissionStats:
        queued = {"interactive": 0, "batch": 0}
        for u in self.upstreams:
            for q in u.queues:
                for e in q:
                    queued[e.klass] += e.present
        return AdmissionStats(queued=queued, in_flight=dict(self._in_flight), decisions=dict(self._decisions))

    def check_integrity(self) -> None:
        sent = sum(u.in_flight() for u in self.upstreams)
        if sent != sum(self._in_flight.values()) or min(self._in_flight.values()) < 0:
            raise RuntimeError(f"{sent} requests sent but {self._in_flight} counted in flight")
        for u in self.upstreams:
            if u.prefill_tokens < -1e-6 or u.in_flight() > self.policy.max_concurrency:
                raise RuntimeError(f"upstream {u.url}: {u.prefill_tokens} prefill tokens, {u.in_flight()} in flight")

    async def acquire(self, info: RequestInfo, max_wait_s: float | None = None) -> Ticket:
        """A ticket once the request is sent to its upstream, or an AdmissionDecision at once."""
        self.check_input(info)
        klass = self.classify(info)
        rank = JOB_RANK if info.background else RANKS[klass]
        now = self.clock()
        self._expire(now)
        if info.key is not None and not info.background and info.key in self.bookings:
            index, entry = self.bookings.claim(info.key)
            return await self._claim(self.upstreams[index], entry, now, info, max_wait_s)
        tokens = max(1, info.input_tokens)
        keys = keys_of(tokens)
        u, pred, alone, upper = self._choose(now, rank, tokens, keys)
        slo = self.options.slo_s[klass]
        if not info.background:
            if self._waiting[klass] >= self.policy.max_queue:
                self._refuse(info, klass, f"queue_full_{klass}", u, now, pred, alone)
            if upper > slo:
                self._refuse(info, klass, f"predicted_ttft_{klass}", u, now, pred, alone)
        entry = self._entry(u, klass, rank, tokens, now, alone, slo, pred, background=info.background)
        entry.future = asyncio.get_running_loop().create_future()
        entry.due_at = now + entry.budget_s
        u.queues[rank].append(entry)
        self.record("admit", "job" if info.background else "predicted")
        self._dispatch(u)
        return await self._wait(u, entry, info, max_wait_s)

    def release(self, ticket: Ticket) -> None:
        """Never blocks; idempotent. The request left its upstream: the next may go."""
        if ticket._released or not isinstance(ticket, PredictedTicket):
            return
        ticket._released = True
        u = self.upstreams[ticket.replica]
        if u.drop(ticket.seq) is not None:
            self._in_flight[ticket.klass] -= 1
        self._dispatch(u)

    def first_byte(self, ticket: PredictedTicket, at: float) -> None:
        """Learn from the request's TTFT since it was sent; count the prediction errors."""
        u = self.upstreams[ticket.replica]
        s = u.get(ticket.seq)
        if s is None or s.seen_first:
            return
        s.seen_first = True
        u.first_byte(ticket.seq)
        u.last_first = max(u.last_first, at)
        measured = at - s.sent_at
        u.observe_error("dispatch", s.predicted_s, measured)
        u.observe_error("admission", s.admitted_s, at - s.arrived_at)
        u.fit.observe(s.x, measured)
        self._dispatch(u)

    # ---- admission ---------------------------------------------------------------------
    def _choose(self, now: float, rank: int, tokens: int, keys: float) -> tuple[UpstreamWork, float, float, float]:
        """(upstream, predicted TTFT, its TTFT alone, the upper bound admission compares)."""
        best = None
        candidates = [u for u in self.upstreams if self._healthy(u.index)] or self.upstreams
        for u in candidates:
            alone, _ = u.predict(tokens, keys)
            w, k = u.ahead(now, rank, self.bookings.show_share, alone)
            pred, _ = u.predict(w + tokens, k + keys)
            upper = pred + Z * u.fit.rel_sd * max(pred, FLOOR_S)
            cand = (upper, u.in_flight(), u.index, pred, alone)
            best = cand if best is None or cand < best else best
        upper, _, index, pred, alone = best  # type: ignore[misc]
        return self.upstreams[index], pred, alone, upper

    def _entry(self, u: UpstreamWork, klass: str, rank: int, tokens: int, now: float, alone: float, slo: float,
               pred: float, background: bool = False) -> Entry:
        self._seq += 1
        step_s = u.seconds_per_token((tokens + 1) / 2) * u.chunk  # one step of prefill
        budget = math.inf if background else max(0.0, slo - alone - step_s)
        return Entry(self._seq, klass, rank, tokens, keys_of(tokens), now, budget, pred, since=now)

    def _refuse(self, info: RequestInfo, klass: str, reason: str, u: UpstreamWork, now: float, pred: float,
                alone: float) -> None:
        """Raise what --overflow says: HandOff, Downgrade (a trimmable chat) or Rejected (429),
        the last with Retry-After = the predicted wait and the client's place booked. The wait
        counts every booking ahead of that place: those clients come back before this one."""
        w, k = u.ahead(now, RANKS[klass], self.bookings.show_share, all_bookings=True)
        booked, _ = u.predict(w + max(1, info.input_tokens), k + keys_of(max(1, info.input_tokens)))
        wait = max(0.0, booked - alone)
        retry = max(1, math.ceil(wait - 1e-6))  # whole seconds, as Retry-After says it
        slo = self.options.slo_s[klass]
        why = (f"predicted TTFT {pred * 1000:.0f} ms is over the {klass} SLO of {slo * 1000:.0f} ms"
               if reason.startswith("predicted") else f"the {klass} queue is full ({self.policy.max_queue} waiting)")
        action = self.policy.overflow
        if action == "async":
            self.record("async", reason)
            raise HandOff(reason, f"{why}; running it as an async job")
        if action == "downgrade" and info.can_downgrade and not info.downgraded and reason.startswith("predicted"):
            fits = self._fitting_tokens(u, now, RANKS[klass], slo) - self.policy.downgrade_reserve_tokens
            if MIN_TRIM_TOKENS <= fits < info.input_tokens:
                self.record("downgrade", reason)
                raise Downgrade(reason, f"{why}; trimming old turns to {fits} tokens", fits)
        if info.key is not None and self.bookings.may_book(wait):
            entry = self._entry(u, klass, RANKS[klass], max(1, info.input_tokens), now, alone, slo, pred)
            u.queues[entry.rank].append(entry)
            self.bookings.add(info.key, u.index, entry, retry, now)
        raise self._rejected(reason, why, pred, wait)

    def _rejected(self, reason: str, why: str, pred: float, wait: float) -> Rejected:
        """The 429, counted: Retry-After = the predicted wait in whole seconds, and the figures."""
        self.record("reject", reason)
        retry = max(1, math.ceil(wait - 1e-6))  # whole seconds, as Retry-After says it
        exc = Rejected(reason, f"{why}; retry in {retry} s", retry_after_s=retry)
        exc.headers = {"X-Tierguard-Predicted-TTFT-Ms": f"{pred * 1000:.1f}",  # type: ignore[attr-defined]
                       "X-Tierguard-Predicted-Wait-Ms": f"{wait * 1000:.1f}"}
        return exc

    def _fitting_tokens(self, u: UpstreamWork, now: float, rank: int, slo: float) -> int:
        """The longest prompt whose prediction is within `slo` at `u` now (bisection)."""
        w, k = u.ahead(now, rank, self.bookings.show_share)
        lo, hi = 0, 1 << 20
        while hi - lo > 1:
            mid = (lo + hi) // 2
            pred, _ = u.predict(w + mid, k + keys_of(mid))
            lo, hi = (mid, hi) if pred + Z * u.fit.rel_sd * max(pred, FLOOR_S) <= slo else (lo, mid)
        return lo

    # ---- bookings ----------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for index, entry in self.bookings.expire(now):
            self.upstreams[index].remove(entry)

    async def _claim(self, u: UpstreamWork, entry: Entry, now: float, info: RequestInfo,
                     max_wait_s: float | None) -> Ticket:
        """The booked client is back: its request takes its place, and is admitted when its
        prediction from there is within its SLO (the prediction itself: the margin was taken
        when the place was kept); otherwise it keeps the place for later."""
        w, k = u.ahead(now, entry.rank, self.bookings.show_share, before=entry.arrival)
        pred, _ = u.predict(w + entry.tokens, k + entry.keys)
        slo = self.options.slo_s[entry.klass]
        if pred > slo and info.key is not None:  # its room was kept: the mean, not the margin, decides
            wait = max(0.0, pred - u.predict(entry.tokens, entry.keys)[0])
            self.bookings.add(info.key, u.index, entry, max(1, math.ceil(wait - 1e-6)), now)
            raise self._rejected(f"predicted_ttft_{entry.klass}", f"back too early: predicted TTFT "
                                 f"{pred * 1000:.0f} ms is over the {entry.klass} SLO of {slo * 1000:.0f} ms",
                                 pred, wait)
        entry.predicted_s = pred
        entry.future = asyncio.get_running_loop().create_future()
        entry.since, entry.due_at = now, now + entry.budget_s
        self.record("admit", "booked_retry")
        self._dispatch(u)
        return await self._wait(u, entry, info, max_wait_s)

    # ---- waiting and sending -----------------------------------------------------------
    async def _wait(self, u: UpstreamWork, entry: Entry, info: RequestInfo, max_wait_s: float | None) -> Ticket:
        fut = entry.future
        assert fut is not None
        klass = entry.klass
        timeout = None
        if not info.background:
            self._waiting[klass] += 1
            timeout = max(self.options.slo_s[klass], self.policy.max_queue_wait_ms / 1000.0)
            if max_wait_s is not None:
                timeout = max(0.0, min(timeout, max_wait_s))
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(fut)
        except (TimeoutError, asyncio.CancelledError) as exc:
            granted = fut.done() and not fut.cancelled()
            if not granted:
                fut.cancel()
                u.remove(entry)
            if isinstance(exc, asyncio.CancelledError):
                if granted:  # sent as the client left: the request never reaches the upstream
                    self.release(fut.result())
                self.record("cancel", "client_left_queue")
                raise
            if granted:
                return fut.result()
            self.record("reject", f"queue_wait_{klass}")
            raise Rejected(f"queue_wait_{klass}", f"waited {timeout:.1f} s for {u.url} without being sent",
                           retry_after_s=self.retry_after_s(klass)) from None
        finally:
            if not info.background:
                self._waiting[klass] -= 1

    def _dispatch(self, u: UpstreamWork) -> None:
        """Send waiters in order while there is room; wake again when there should be."""
        if u.wake is not None:
            u.wake.cancel()
            u.wake = None
        now = self.clock()
        waiting = held = False
        back = u.returning(now, HOLD_S) if self.bookings.show_share >= 0.5 else []
        for e in u.order(now):
            if e.future is None or e.future.done():
                u.remove(e)
                continue
            held = bool(back) and u.held_for(e, back, now)
            if held or not u.has_room(now, self.policy.max_concurrency):
                waiting = True
                break
            self._send(u, e, now)
        if waiting and (held or u.prefilling):  # else a release or a first byte wakes it
            delay = u.room_in(now) if u.prefilling else 0.02
            u.wake = asyncio.get_running_loop().call_later(delay, self._dispatch, u)

    def _send(self, u: UpstreamWork, e: Entry, now: float) -> None:
        u.remove(e)
        w, k = u.prefill_left(now)
        pred, x = u.predict(w + u.others.tokens + e.tokens, k + u.others.keys + e.keys)
        ticket = PredictedTicket(klass=e.klass, queue_wait_s=now - e.since, admitted_at=now, replica=u.index,
                                 seq=e.seq, predicted_s=e.predicted_s, _owner=self)
        u.add_sent(Sent(e.seq, e.klass, e.tokens, e.keys, now, x, pred, e.predicted_s, e.since))
        self._in_flight[e.klass] += 1
        assert e.future is not None
        e.future.set_result(ticket)

    def local_work(self) -> dict[str, list[float]]:
        """This gate's work per upstream URL, for the other gates (`ttft_shared.py`):
        [prefill tokens sent, their keys, tokens waiting here, their keys, decodes]."""
        now = self.clock()
        return {u.url: u.work_row(now) for u in self.upstreams}
