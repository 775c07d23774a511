"""Continuous batching: which sequences run this step, and how many tokens each.

A step's token budget (max_num_batched_tokens) is spent in this order:
  1. running sequences that decode (1 token each), oldest first;
  2. running sequences in the middle of a chunked prefill;
  3. waiting sequences, admitted FCFS while there is budget, a sequence slot
     (max_num_seqs) and KV blocks for their first chunk.
When a running sequence cannot get a block, the newest other running sequence is
preempted by recompute (its blocks are freed, it goes back to the front of the queue;
its full blocks stay in the prefix cache, so the recompute is often cheap).

With the tiered KV store (`tiers`, see tiers.py) the pool is guarded harder:
  - admission needs room for the whole remaining prompt plus the unfinished prefills of
    running sequences (a long request waits for room instead of thrashing the pool);
  - a preempted sequence's full blocks are swapped out to host RAM first, and its
    re-admission restores them asynchronously (LOADING) instead of recomputing;
  - a waiting sequence whose prefix misses on the device but hits host/disk is staged
    (LOADING) and skipped until its blocks are resident; other sequences go ahead;
  - request classes: an interactive request goes before batch ones, and when it waits for
    room a running batch sequence holds, that one is swapped to host RAM. A request past
    its class's TTFT budget in the queue is no longer overtaken (nothing starves).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from tierguard.engine.block_manager import BlockManager
from tierguard.engine.config import EngineConfig
from tierguard.engine.sequence import Sequence, SequenceStatus
from tierguard.kv.contract import BATCH

if TYPE_CHECKING:
    from tierguard.engine.tiers import EngineTiers


# How far behind a head that waits for room the scheduler looks for a request that fits.
LOOKAHEAD = 8


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # True when this chunk reaches the end of the sequence, so a token is sampled.
    # Fixed at scheduling time (postprocessing moves num_computed_tokens).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes (1 token) first
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()  # front = next to admit
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        self.tiers: EngineTiers | None = None  # set by the engine when tiers are configured
        # An interactive request waits for room that a running batch sequence holds: the
        # next step swaps that sequence out (not this one: it may be in this step's batch).
        self._room_wanted = False

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting[seq.seq_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or (self.tiers is not None and self.tiers.loading))

    def requeue_front(self, seq: Sequence) -> None:
        """A preempted sequence, or one whose staged load ended, goes back to the head of the queue."""
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting[seq.seq_id] = seq
        self.waiting.move_to_end(seq.seq_id, last=False)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        tiers = self.tiers
        if tiers is not None and tiers.abort_loading(seq):
            tiers.forget(seq)
            return
        if self.waiting.pop(seq.seq_id, None) is None:
            self.running = [s for s in self.running if s is not seq]
            if tiers is not None:
                tiers.on_free(seq, preempted=False)
        if tiers is not None:
            tiers.forget(seq)
        self.bm.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        if self._room_wanted:
            self._room_wanted = False
            victim = self._newest_batch()
            if victim is not None:  # swapped to host; restored when room returns
                self._preempt(victim)
                out.preempted.append(victim)
        # Decodes first protects inter-token latency from long prefills.
        order = sorted(self.running, key=lambda s: s.num_pending_tokens > 1)
        pager = self.tiers.pager if self.tiers is not None else None
        if pager is not None:
            # Like demand paging: what waited on disk runs first, evicting what just ran.
            order.sort(key=lambda s: not pager.is_paged_out(s))
        paged_now: set[str] = set()  # naive mode: paged out in this step, not paged back in it
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if pager is not None and pager.is_paged_out(seq):
                if seq.seq_id in paged_now or not self._page_in(seq, scheduled_ids, paged_now, out):
                    continue
            n = min(seq.num_pending_tokens, budget)
            while not self.bm.ensure_slots(seq, n):
                victim = self._newest_unscheduled(scheduled_ids, exclude=seq) or seq
                if pager is not None and pager.page_out(victim):
                    paged_now.add(victim.seq_id)
                    if victim is seq:
                        break  # it pages itself out and runs after a page-in in a later step
                    continue
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in paged_now:
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n

        # Admitting while preempting would only thrash.
        while (
            budget > 0 and self.waiting and not out.preempted and len(self.running) < self.config.max_num_seqs
        ):
            seq = self._head()
            match = self.bm.lookup(seq)
            n = min(len(seq) - len(match.block_ids) * self.bm.block_size, budget)
            # Keep one free block per running sequence, so admitting does not force the
            # next decode step straight into preemption.
            reserve = len(self.running)
            if self.tiers is not None:
                staged = self._tiered_admission(seq, match, reserve)
                if staged is None:
                    if self._let_smaller_pass(seq, reserve):
                        continue  # a request that fits now goes first; the head keeps its place
                    self._room_wanted = self.tiers.request_class(seq) != BATCH
                    break  # waits for room
                if staged:
                    continue  # LOADING: out of the queue until its blocks arrive
            if not self.bm.can_admit(seq, match, n, reserve=reserve):
                break
            del self.waiting[seq.seq_id]
            self.bm.admit(seq, match)
            if seq.num_preemptions == 0 and not seq.num_output_tokens:
                seq.num_cached_tokens = seq.num_computed_tokens
            if not self.bm.ensure_slots(seq, n):  # can_admit guaranteed the blocks
                raise RuntimeError("scheduler: admission lost its blocks")
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

        # Keep decodes (single-token chunks) at the front: the runner batches them together.
        out.scheduled.sort(key=lambda s: s.num_tokens > 1)
        return out

    def _tiered_admission(self, seq: Sequence, match, reserve: int) -> bool | None:
        """None: wait for room; True: the head is now LOADING (dequeued); False: admit normally."""
        tiers = self.tiers
        if tiers is None:
            return False
        if tiers.pager is not None:
            return False  # the failure mode under test: eager admission, paging on the decode path
        if not self._fits_whole(seq, match, reserve):
            return None
        if seq.tier_checked or not match.missed_hashes:
            return False
        seq.tier_checked = True  # one staging attempt per stage of work
        if not tiers.start_load(seq, match):
            return False
        self.waiting.pop(seq.seq_id)
        return True

    def _fits_whole(self, seq: Sequence, match, reserve: int) -> bool:
        """Room for the whole remaining prompt, after the unfinished prefills of running ones."""
        whole = len(seq) - len(match.block_ids) * self.bm.block_size
        pending = sum(
            self.bm.blocks_needed(s, s.num_pending_tokens) for s in self.running if s.num_pending_tokens > 1
        )
        return self.bm.can_admit(seq, match, whole, reserve=reserve + pending)

    def _head(self) -> Sequence:
        """The next request to admit: the first one, except that with tiers an interactive
        request within LOOKAHEAD goes before batch ones still within their TTFT budget."""
        first = next(iter(self.waiting.values()))
        tiers = self.tiers
        if tiers is None or tiers.pager is not None or tiers.request_class(first) != BATCH:
            return first
        if self._overdue(first):
            return first
        for seq in islice(self.waiting.values(), 1, 1 + LOOKAHEAD):
            if tiers.request_class(seq) != BATCH:
                return seq
        return first

    def _overdue(self, seq: Sequence) -> bool:
        tiers = self.tiers
        if tiers is None:
            return True
        budget_s = tiers.contract.budgets.get(tiers.request_class(seq), 0.0) / 1000.0
        return time.monotonic() - seq.queued_at > budget_s

    def _newest_batch(self) -> Sequence | None:
        tiers = self.tiers
        if tiers is None:
            return None
        for seq in reversed(self.running):
            if tiers.request_class(seq) == BATCH and seq.block_table:
                return seq
        return None

    def _let_smaller_pass(self, head: Sequence, reserve: int) -> bool:
        """While a head that does not fit is within its class's TTFT budget, a later request
        (of the next LOOKAHEAD) that fits now may go first; past the budget the queue is
        strict FIFO so the long one cannot starve. True: that request is now the head."""
        if self.tiers is None or self._overdue(head):
            return False
        for cand in islice(self.waiting.values(), 0, 1 + LOOKAHEAD):
            if cand is head:
                continue
            if len(cand) < len(head) and self._fits_whole(cand, self.bm.lookup(cand), reserve):
                self.waiting.move_to_end(cand.seq_id, last=False)
                return True
        return False

    def _newest_unscheduled(self, scheduled_ids: set[str], exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            # A running sequence without blocks is paged out (naive mode): nothing to take.
            if seq is not exclude and seq.seq_id not in scheduled_ids and seq.block_table:
                return seq
        return None

    def _page_in(self, seq: Sequence, scheduled_ids: set[str], paged_now: set[str], out) -> bool:
        """Naive mode: read a paged-out sequence back inside this step, paging out the
        newest unscheduled ones to make room. False: it does not run this step."""
        pager = self.tiers.pager if self.tiers is not None else None
        if pager is None:
            return True
        while self.bm.pool.num_free < pager.blocks_needed(seq):
            victim = self._newest_unscheduled(scheduled_ids, exclude=seq)
            if victim is None or not pager.page_out(victim):
                return False
            paged_now.add(victim.seq_id)
        resident = pager.page_in(seq)
        if resident is False:  # a block was lost on disk: recompute from scratch
            self._preempt(seq)
            out.preempted.append(seq)
        return bool(resident)

    def _preempt(self, seq: Sequence) -> None:
        self.running = [s for s in self.running if s is not seq]
        if self.tiers is not None:
            self.tiers.on_free(seq, preempted=True)
            self.tiers.forget(seq)
            seq.tier_checked = False  # its re-admission is a new stage: restore from host
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.requeue_front(seq)
        self.num_preemptions += 1
