"""The discrete-event loop: a bench client and an engine thread on one simulated clock.

It plays what a served engine and the bench client do, in the order they do it:

    client  dispatch a request at its due time (open loop) or when a concurrency slot
            opens (closed loop); it reaches the engine `send_s` later (HTTP, tokenizing)
    engine  the async engine's loop: take the requests that arrived, run one `step()`
            (the clock moves by the step's cost inside it), hand the outputs over, and
            spend `gap` on the work between steps; with nothing to do, wait for the
            next arrival
    client  a token produced by a step is seen a delivery latency after the step ends
            (a request's first: the calibrated median; every later one: a draw from the
            calibrated distribution, never before the request's previous token); the
            last one ends the request and frees its slot

and records every request as the bench does (`RequestRecord`: scheduled, sent, first
token, each chunk, end), so the sweep's own code judges a simulated cell. A request
that is still unfinished `timeout_s` after it was sent is aborted and counted as a
timeout, as the bench counts it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from tierguard.bench.records import FAILED, OK, TIMEOUT, RequestRecord
from tierguard.common.errors import TierguardError
from tierguard.engine.api import SamplingParams
from tierguard.predict.costmodel import StepCost
from tierguard.predict.simengine import SimClock, SimEngine
from tierguard.predict.workload import Workload

# Between two cells the sweep stops one bench client and starts the next (and scrapes
# /metrics): the engine idles about this long; transfers still in flight finish.
CELL_PAUSE_S = 2.0
WARMUP_PROMPT = [17, 18]  # lifecycle.py's "warm up" prompt, two tokens, max_tokens 4
MAX_STEPS = 2_000_000


@dataclass
class ClientTiming:
    """Latencies outside the engine's steps, measured by calibration.

    `deliver_samples_s` is the measured distribution of the time from the end of the
    step that produced a token to the client having it (the event loop, the SSE write,
    the client's read, the operating system's scheduling of all three), for every token
    but a request's first. A simulated token draws one, so that noise reaches the
    predicted inter-token p99 (at one stream on a small model it is most of it); without
    samples every token takes `deliver_s`. A first token goes out with the response's
    headers and first event: it takes `first_deliver_s` (their median) when measured.
    """

    send_s: float = 0.0  # the client sends -> the engine has the request
    deliver_s: float = 0.0  # a step ends -> the client has its tokens (median)
    deliver_samples_s: list[float] = field(default_factory=list)
    first_deliver_s: float | None = None

    def deliver(self, rng: np.random.Generator | None, first: bool = False) -> float:
        if first and self.first_deliver_s is not None:
            return self.first_deliver_s
        if rng is None or not self.deliver_samples_s:
            return self.deliver_s
        return self.deliver_samples_s[int(rng.integers(len(self.deliver_samples_s)))]

    def to_json(self) -> dict:
        return {"send_ms": self.send_s * 1e3, "deliver_ms": self.deliver_s * 1e3,
                "first_deliver_ms": None if self.first_deliver_s is None else self.first_deliver_s * 1e3,
                "deliver_samples_ms": [round(x * 1e3, 4) for x in self.deliver_samples_s]}

    @classmethod
    def from_json(cls, d: dict) -> ClientTiming:
        first = d.get("first_deliver_ms")
        return cls(d.get("send_ms", 0.0) / 1e3, d.get("deliver_ms", 0.0) / 1e3,
                   [x / 1e3 for x in d.get("deliver_samples_ms", [])], None if first is None else first / 1e3)


class Simulation:
    """One simulated server, kept across the cells of a variant as the sweep keeps its
    engine (prefix cache, tiers and the step budget's estimates carry over)."""

    def __init__(self, engine: SimEngine, clock: SimClock, cost: StepCost, client: ClientTiming,
                 rng: np.random.Generator | None = None, scale: float = 1.0) -> None:
        self.engine, self.clock, self.cost, self.client = engine, clock, cost, client
        self.rng, self.scale = rng, scale
        self._next_id = 0
        self.steps = 0
        self.step_end = clock.now  # when the last step's compute ended (before its gap)

    # -- the engine thread ----------------------------------------------------------------
    def _step(self) -> list:
        before = self.clock.now
        outputs = self.engine.step()
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise RuntimeError("simulation did not finish within its step limit")
        sampled = len(outputs)
        self.step_end = self.clock.now
        if self.clock.now > before:
            self.clock.sleep(self.cost.gap_seconds(sampled, self.rng, self.scale))
        return outputs

    def _next_event(self) -> float | None:
        connector = self.engine.connector
        worker = getattr(connector, "worker", None)
        jobs = getattr(worker, "_jobs", None)
        return jobs[0].done_at if jobs else None

    def warm_up(self, n: int = 2) -> None:
        """The sweep's warm-up requests after a start (lifecycle.py), one at a time."""
        for _ in range(n):
            rid = self._rid()
            self.engine.add_request(rid, list(WARMUP_PROMPT), SamplingParams(max_tokens=4, temperature=0.0))
            while self.engine.has_unfinished():
                self._idle_or_step()
            self.clock.sleep(self.client.send_s + self.client.deliver_s)

    def pause(self, seconds: float = CELL_PAUSE_S) -> None:
        """Idle between cells; what is still in flight finishes."""
        end = self.clock.now + seconds
        while self.engine.has_unfinished() and self.clock.now < end:
            self._idle_or_step()
        self.clock.advance_to(end)

    def _idle_or_step(self) -> list:
        before = self.clock.now
        outputs = self._step()
        if self.clock.now == before:  # nothing ran and nothing waited: jump to what comes next
            nxt = self._next_event()
            self.clock.advance_to(nxt if nxt is not None and nxt > before else before + 1e-3)
        return outputs

    def _rid(self) -> str:
        self._next_id += 1
        return f"sim-{self._next_id}"

    # -- one cell --------------------------------------------------------------------------
    def run(self, wl: Workload) -> list[RequestRecord]:
        """Send the workload as the bench client would; return its records (times relative
        to the cell's start, as in requests.jsonl)."""
        clock, client, engine = self.clock, self.client, self.engine
        t0 = clock.now
        n = wl.num_requests
        limit = wl.concurrency if wl.concurrency else math.inf
        timeout = wl.config.timeout
        records: dict[str, RequestRecord] = {}
        rid_of: list[str] = []
        arrivals: list[tuple[float, int, str]] = []  # (time at the engine, order, rid)
        deadlines: list[tuple[float, str]] = []
        waiting_slot: list[int] = []  # open loop: dispatched, waiting for a slot
        in_flight = 0
        next_closed = 0
        done = 0

        def send(i: int, scheduled: float, at: float) -> None:
            nonlocal in_flight
            rid = self._rid()
            rid_of.append(rid)
            rec = RequestRecord(index=i, input_len=len(wl.prompts[i]), output_len_requested=wl.output_lens[i],
                                scheduled_s=scheduled - t0, dispatched_s=(scheduled if wl.closed_loop else at) - t0,
                                slot_s=at - t0, sent_s=at - t0, token_count_source="simulated",
                                prompt_tokens=len(wl.prompts[i]))
            records[rid] = rec
            in_flight += 1
            heapq.heappush(arrivals, (at + client.send_s, len(rid_of), rid))
            heapq.heappush(deadlines, (at + timeout, rid))

        def free_slot(at: float) -> None:
            nonlocal in_flight, next_closed
            in_flight -= 1
            if wl.closed_loop:
                if next_closed < n:
                    send(next_closed, at, at)
                    next_closed += 1
            elif waiting_slot:
                i = waiting_slot.pop(0)
                send(i, t0 + wl.offsets[i], max(at, t0 + wl.offsets[i]))

        if wl.closed_loop:
            first = min(n, int(limit) if math.isfinite(limit) else n)
            for i in range(first):
                send(i, t0, t0)
            next_closed = first
            pending_open: list[int] = []
        else:
            pending_open = list(range(n))

        def finish(rid: str, status: str, at: float, error: str | None = None) -> None:
            nonlocal done
            rec = records[rid]
            if rec.end_s is not None:
                return
            rec.status, rec.end_s, rec.error = status, at - t0, error
            done += 1
            free_slot(at)

        while done < n:
            now = clock.now
            while pending_open and t0 + wl.offsets[pending_open[0]] <= now + 1e-12:
                i = pending_open.pop(0)
                due = t0 + wl.offsets[i]
                if in_flight < limit:
                    send(i, due, due)
                else:
                    waiting_slot.append(i)
            while arrivals and arrivals[0][0] <= now:
                _, _, rid = heapq.heappop(arrivals)
                rec = records[rid]
                i = rec.index
                try:
                    engine.add_request(rid, wl.prompts[i], SamplingParams(
                        max_tokens=wl.output_lens[i], temperature=wl.config.temperature,
                        ignore_eos=wl.config.ignore_eos))
                except TierguardError as exc:
                    finish(rid, FAILED, now, str(exc))
            while deadlines and (deadlines[0][0] <= now or records[deadlines[0][1]].end_s is not None):
                when, rid = heapq.heappop(deadlines)
                if records[rid].end_s is None and when <= now:
                    engine.abort(rid)
                    finish(rid, TIMEOUT, when, f"no answer within {timeout:g}s")
            if engine.has_unfinished():
                outputs = self._idle_or_step()
                ended = self.step_end
                for out in outputs:
                    rec = records.get(out.request_id)
                    if rec is None or rec.end_s is not None:
                        continue
                    last = rec.chunk_times_s[-1] if rec.chunk_times_s else 0.0
                    at = max(ended + client.deliver(self.rng, first=not rec.chunk_times_s), t0 + last)
                    if out.new_token_ids:
                        t = at - t0
                        if rec.first_token_s is None:
                            rec.first_token_s = t
                        rec.chunk_times_s.append(t)
                        rec.chunk_tokens.append(len(out.new_token_ids))
                        rec.output_tokens += len(out.new_token_ids)
                    if out.finished:
                        ok = out.finish_reason in ("length", "stop")
                        finish(out.request_id, OK if ok else FAILED, at, None if ok else out.finish_reason)
                continue
            upcoming = [a[0] for a in arrivals[:1]]
            if pending_open:
                upcoming.append(t0 + wl.offsets[pending_open[0]])
            if deadlines:
                upcoming.append(deadlines[0][0])
            if not upcoming:
                break
            clock.advance_to(min(upcoming))
        return [records[r] for r in rid_of]
