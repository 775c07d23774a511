"""One upstream as predicted admission sees it: work sent there, work waiting for it, its fit.

Mechanism only (no decision is taken here; `ttft_admission.py` takes them):

- **sent**: requests handed to the upstream, in the order they were sent. Until its first
  byte comes back a request is *prefilling* and its prompt counts as work ahead of later
  ones; then it is *decoding* and counts as one running decode. The engine prefills in
  arrival order, so when a request's first byte arrives every request sent before it is
  taken as past its prefill too (a non-streaming request never shows its first byte).
- **progress**: the prefill work still ahead is the prefilling prompts less what the
  upstream did since the later of the last first byte and the oldest send, at the fitted
  seconds per token. The gate never sees an engine's progress; this is its estimate.
- **queue**: requests admitted but not yet sent, per rank, in their order, and bookings
  (a rejected client's place, kept for its retry; `future` None) weighted by the share
  of bookings whose clients came back.
- **held room**: a waiter behind a booking whose client is due back before the waiter's
  own prefill would be done is not sent yet, so the returning client finds the room its
  Retry-After promised (only while most booked clients do come back).
- **others**: prefill tokens, keys and decodes other gates report for this upstream
  (`ttft_shared.py`).

Sums are kept incrementally, so the work ahead of an arrival costs one pass over the
gate's queue (bounded by --max-queue per class, plus bookings) and none over what was sent.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from tierguard.common.histogram import LatencyHistogram
from tierguard.gate.ttft_model import OnlineFit, features

# predicted - measured TTFT, seconds (signed: negative = the prediction was short)
ERROR_BUCKETS = (-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0,
                 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ABS_ERROR_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATE_S = 0.5  # a booked client this late is no longer waited for by the dispatcher
STAGES = ("admission", "dispatch")  # from the arrival, as admission predicted; from the send


@dataclass(eq=False)
class Entry:
    """A request admitted to wait for its upstream, or a booking for a rejected one's retry."""

    seq: int
    klass: str
    rank: int  # dispatch order of its class: 0 interactive, 1 batch, 2 async jobs
    tokens: int
    keys: float
    arrival: float  # its place: FIFO within its rank
    budget_s: float  # after waiting this long it goes before everyone who has not (inf: never)
    predicted_s: float = 0.0  # admission's prediction of its TTFT from arrival
    future: asyncio.Future | None = None  # None: a booking whose client has not come back
    key: str | None = None  # the request's retry key (bookings)
    since: float = 0.0  # when it started waiting here (its arrival, or its booking's claim)
    back_at: float = math.inf  # a booking: when its client was told to come back
    expires: float = math.inf  # a booking's end
    due_at: float = math.inf  # present since + budget

    @property
    def present(self) -> bool:
        return self.future is not None


@dataclass(eq=False)
class Sent:
    seq: int
    klass: str
    tokens: int
    keys: float
    sent_at: float
    x: list[float]  # the closed form's features when it was sent
    predicted_s: float  # TTFT from its send, as predicted then
    admitted_s: float  # TTFT from its arrival, as predicted at admission
    arrived_at: float
    prefilling: bool = True
    seen_first: bool = False


@dataclass
class Others:
    """What the other gates in front of this upstream report (`ttft_shared.py`)."""

    tokens: float = 0.0  # prefill tokens they sent and not yet prefilled, plus those waiting there
    keys: float = 0.0
    decodes: float = 0.0
    sent_tokens: float = 0.0  # of `tokens`, those already at the upstream


@dataclass
class UpstreamWork:
    index: int
    url: str
    fit: OnlineFit
    queues: list[list[Entry]] = field(default_factory=lambda: [[], [], []])
    prefilling: OrderedDict[int, Sent] = field(default_factory=OrderedDict)  # in the order sent
    decoding: dict[int, Sent] = field(default_factory=dict)
    prefill_tokens: float = 0.0
    prefill_keys: float = 0.0
    last_first: float = -math.inf
    others: Others = field(default_factory=Others)
    wake: asyncio.TimerHandle | None = None
    errors: dict[str, LatencyHistogram] = field(  # signed
        default_factory=lambda: {s: LatencyHistogram(ERROR_BUCKETS) for s in STAGES})
    abs_errors: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {s: LatencyHistogram(ABS_ERROR_BUCKETS) for s in STAGES})

    def observe_error(self, stage: str, predicted_s: float, measured_s: float) -> None:
        self.errors[stage].observe(predicted_s - measured_s)
        self.abs_errors[stage].observe(abs(predicted_s - measured_s))

    @property
    def chunk(self) -> int:
        return self.fit.prior.chunk

    def in_flight(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def decodes(self) -> float:
        return len(self.decoding) + self.others.decodes

    def seconds_per_token(self, keys_per_token: float) -> float:
        """Marginal prefill time of one more prompt token at the current decodes."""
        _base, per_token, per_key, per_step, per_decode = self.fit.coef
        d = self.decodes()
        return per_token + per_key * keys_per_token + (per_step + per_decode * d) / max(1.0, self.chunk - d)

    def prefill_left(self, now: float) -> tuple[float, float]:
        """(tokens, keys) of sent prompts not yet prefilled, as estimated now."""
        w, k = self.prefill_tokens, self.prefill_keys
        if w <= 0 or not self.prefilling:
            return 0.0, 0.0
        oldest = next(iter(self.prefilling.values()))
        mark = max(self.last_first, oldest.sent_at)
        t_tok = self.seconds_per_token(k / w)
        done = (now - mark) / t_tok if t_tok > 0 else 0.0
        left = max(0.0, 1.0 - done / w)
        return w * left, k * left

    def predict(self, tokens: float, keys: float) -> tuple[float, list[float]]:
        """TTFT of a request with `tokens`/`keys` of prefill to do (ahead and its own) now."""
        x = features(tokens, keys, self.decodes(), self.chunk)
        return self.fit.predict(x), x

    def ahead(self, now: float, rank: int, show_share: float, own_s: float = 0.0,
              before: float = math.inf, all_bookings: bool = False) -> tuple[float, float]:
        """(tokens, keys) that go to the engine before a request of `rank` that took its
        place at `before` (a new one: now) would: prefill left here and at other gates,
        everything waiting of a better rank or ahead in its own, bookings among those whose
        clients are due back before it would be sent (weighted by `show_share`, the share
        of clients that do come back), and lower ranks' waiters that will have waited out
        their budget by then. `own_s`: its own service time, for the first estimate of how
        long it waits. `all_bookings`: every booking ahead counts, due back before it or not
        (the wait of a request that will itself come back later)."""
        w, k = self.prefill_left(now)
        w, k = w + self.others.tokens, k + self.others.keys
        later: list[Entry] = []
        for q_rank, queue in enumerate(self.queues):
            for e in queue:
                first = q_rank < rank or (q_rank == rank and e.arrival < before)
                if not e.present:
                    if first and all_bookings:
                        w, k = w + e.tokens * show_share, k + e.keys * show_share
                    elif first:
                        later.append(e)
                elif first or e.due_at <= now:
                    w, k = w + e.tokens, k + e.keys
                elif e.due_at < math.inf:
                    later.append(e)
        if later:
            first, _ = self.predict(w, k)
            horizon = now + max(0.0, first - own_s)  # when it would be sent, at the first estimate
            for e in later:
                if e.present and e.due_at <= horizon:
                    w, k = w + e.tokens, k + e.keys
                elif not e.present and e.back_at <= horizon:
                    w, k = w + e.tokens * show_share, k + e.keys * show_share
        return w, k

    def order(self, now: float) -> list[Entry]:
        """Waiting requests in dispatch order: those that waited out their budget first
        (earliest due first), then by rank, FIFO within a rank. Bookings are left out."""
        waiting = [e for q in self.queues for e in q if e.present]
        due = sorted((e for e in waiting if e.due_at <= now), key=lambda e: e.due_at)
        return due + [e for e in waiting if e.due_at > now]

    def has_room(self, now: float, max_in_flight: int) -> bool:
        """The unfinished prefill here is under one step: the engine can take another prompt."""
        if self.in_flight() >= max_in_flight:
            return False
        left, _ = self.prefill_left(now)
        return left + self.others.sent_tokens < max(1.0, self.chunk - self.decodes())

    def room_in(self, now: float) -> float:
        """Seconds until the prefill left here drops under one step, at the fitted speed
        (50 ms when the fit knows no speed yet; between 2 ms and 0.5 s)."""
        left, keys = self.prefill_left(now)
        t_tok = self.seconds_per_token(keys / left if left else 0.0)
        room = max(1.0, self.chunk - self.decodes())
        delay = (left - room + 1) * t_tok if t_tok > 0 and left >= room else 0.05
        return min(0.5, max(0.002, delay))

    def returning(self, now: float, within_s: float) -> list[Entry]:
        """Bookings whose clients are due back within `within_s` (or were, LATE_S ago)."""
        return [e for q in self.queues for e in q
                if not e.present and now - LATE_S <= e.back_at <= now + within_s]

    def held_for(self, e: Entry, back: list[Entry], now: float) -> bool:
        """Whether sending `e` now would take the room of a client due back before `e`'s
        own prefill is done, whose place is ahead of it (a waiter past its budget is never held)."""
        if e.due_at <= now:
            return False
        own, _ = self.predict(e.tokens, e.keys)
        return any((b.rank < e.rank or (b.rank == e.rank and b.arrival < e.arrival)) and b.back_at <= now + own
                   for b in back)

    def remove(self, entry: Entry) -> None:
        queue = self.queues[entry.rank]
        if entry in queue:
            queue.remove(entry)

    def work_row(self, now: float) -> list[float]:
        """[prefill tokens sent, their keys, tokens waiting here, their keys, decodes]."""
        (w, k), (qw, qk) = self.prefill_left(now), self.queued()
        return [round(w, 1), round(k, 1), round(qw, 1), round(qk, 1), len(self.decoding)]

    def queued(self) -> tuple[float, float]:
        """(tokens, keys) waiting here for this upstream (present waiters only)."""
        w = k = 0.0
        for q in self.queues:
            for e in q:
                if e.present:
                    w, k = w + e.tokens, k + e.keys
        return w, k

    def add_sent(self, s: Sent) -> None:
        self.prefilling[s.seq] = s
        self.prefill_tokens += s.tokens
        self.prefill_keys += s.keys

    def first_byte(self, seq: int) -> list[Sent]:
        """`seq` showed its first byte: it and every request sent before it are past their
        prefill. Returns those moved (in the order sent)."""
        if seq not in self.prefilling:
            return []
        moved = []
        while self.prefilling:
            s_seq, s = self.prefilling.popitem(last=False)
            s.prefilling = False
            self.decoding[s_seq] = s
            moved.append(s)
            self._take(s)
            if s_seq == seq:
                break
        return moved

    def get(self, seq: int) -> Sent | None:
        return self.prefilling.get(seq) or self.decoding.get(seq)

    def drop(self, seq: int) -> Sent | None:
        s = self.decoding.pop(seq, None)
        if s is None:
            s = self.prefilling.pop(seq, None)
            if s is not None:
                self._take(s)
        return s

    def _take(self, s: Sent) -> None:
        self.prefill_tokens -= s.tokens
        self.prefill_keys -= s.keys
        if not self.prefilling:
            self.prefill_tokens = self.prefill_keys = 0.0  # no float drift survives an empty set
