"""Continuous batching: which sequences run this step, and how many tokens each.

A step's token budget (max_num_batched_tokens) is spent in this order:
  1. running sequences that decode (1 token each), oldest first;
  2. running sequences in the middle of a chunked prefill;
  3. waiting sequences, admitted FCFS while there is budget, a sequence slot
     (max_num_seqs) and KV blocks for their first chunk.
When a running sequence cannot get a block, the newest other running sequence is
preempted by recompute (its blocks are freed, it goes back to the front of the queue;
its full blocks stay in the prefix cache, so the recompute is often cheap).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tierguard.engine.block_manager import BlockManager
from tierguard.engine.config import EngineConfig
from tierguard.engine.sequence import Sequence, SequenceStatus


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()  # front = next to admit
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.seq_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if self.waiting.pop(seq.seq_id, None) is None:
            self.running = [s for s in self.running if s is not seq]
        self.bm.free(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # Decodes first protects inter-token latency from long prefills.
        order = sorted(self.running, key=lambda s: s.num_pending_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_pending_tokens, budget)
            while not self.bm.ensure_slots(seq, n):
                victim = self._newest_unscheduled(scheduled_ids, exclude=seq) or seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n

        # Admitting while preempting would only thrash.
        while (
            budget > 0 and self.waiting and not out.preempted and len(self.running) < self.config.max_num_seqs
        ):
            seq = next(iter(self.waiting.values()))
            if seq.status is SequenceStatus.LOADING:
                break  # the tier store will flip it back to WAITING when its blocks are in
            match = self.bm.lookup(seq)
            n = min(len(seq) - len(match.block_ids) * self.bm.block_size, budget)
            # Keep one free block per running sequence, so admitting does not force the
            # next decode step straight into preemption.
            if not self.bm.can_admit(seq, match, n, reserve=len(self.running)):
                break
            self.waiting.popitem(last=False)
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

    def _newest_unscheduled(self, scheduled_ids: set[str], exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and seq.seq_id not in scheduled_ids:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running = [s for s in self.running if s is not seq]
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.seq_id] = seq
        self.waiting.move_to_end(seq.seq_id, last=False)
        self.num_preemptions += 1
