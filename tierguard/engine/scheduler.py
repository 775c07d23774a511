"""Continuous batching: which sequences run this step, and how many tokens each.

A step's token budget (max_num_batched_tokens) is spent in this order:
  1. running sequences that decode (1 token each), oldest first;
  2. running sequences in the middle of a chunked prefill;
  3. waiting sequences, admitted while there is budget, a sequence slot (max_num_seqs)
     and KV blocks for their first chunk, in the order the admission policy gives.
Prefill tokens (2 and 3) in a step that carries decodes are further capped by the step
budget (step_budget.py, `--target-itl-ms`), so one prefill cannot stretch every
stream's inter-token gap; with `--itl-slo-ms` the budget also says when the batch is
full (3 waits).
Under `--itl-slo-ms`, when no running sequence decodes, the batch fills as a wave: while
a decode step at the wave's size stays within the SLO's share (`StepBudget.wave_admits`),
more waiting sequences join, their prefills run in steps with no decode beside them (so
no SLO caps them), and each keeps its last prompt token back until every member is
ready; one release step then computes those tokens and all start decoding together.
Why: on a CPU where a prefill chunk does not fit beside the decodes within the SLO,
admission ran one sequence at a time (its prefill alone, then its decode alone); a wave
pays the same prefills once per member but decodes them in one batch (SmolLM2 int8
under a 15 ms SLO on 2 cores, C=32: see README).
When a running sequence cannot get a block, the newest other running sequence is
preempted by recompute (its blocks are freed, it goes back to the front of the queue;
its full blocks stay in the prefix cache, so the recompute is often cheap).

Two collaborators, each called once per hook:
  - `admission` (admission.py): which waiting request is next, whether it has room, and
    which running one yields room; FIFO without tiers, the cold contract's class order
    with them;
  - `connector` (tierguard/kv/connector.py): on admission a tier-resident prefix is
    staged and the sequence leaves the queue until the engine's poll hands it back; a
    sequence leaving the device (finished or preempted) has its full blocks copied out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tierguard.engine.admission import AdmissionPolicy, FifoAdmission
from tierguard.engine.block_manager import BlockManager, PrefixMatch
from tierguard.engine.config import EngineConfig
from tierguard.engine.sequence import Sequence, SequenceStatus
from tierguard.engine.step_budget import StepBudget
from tierguard.kv.connector import KVConnector, NoConnector


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
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        connector: KVConnector | None = None,
        admission: AdmissionPolicy | None = None,
        step_budget: StepBudget | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.connector = connector or NoConnector()
        self.admission = admission or FifoAdmission()
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()  # front = next to admit
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        self.step_budget = step_budget or StepBudget(
            config.target_itl_ms,
            min_tokens=config.block_size,
            prefill_share=config.prefill_share,
            slo_ms=config.itl_slo_ms,
        )
        self._prefill_cap = config.max_num_batched_tokens  # prefill tokens left in this step
        self._caught_up = False  # the last step ran decodes alone for a held token (_catch_up)
        # Wave (see the module docstring): members whose last prompt token waits for release.
        self._held: set[str] = set()
        self._wave = False  # this step: an SLO is set and no running sequence decodes
        self._releasing = False  # this step: every running sequence is a held wave member

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting[seq.seq_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requeue_front(self, seq: Sequence) -> None:
        """A preempted sequence, or one whose staged load ended, goes back to the head of the queue."""
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting[seq.seq_id] = seq
        self.waiting.move_to_end(seq.seq_id, last=False)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        self._held.discard(seq.seq_id)
        if self.waiting.pop(seq.seq_id, None) is None and seq in self.running:
            self.running.remove(seq)
            self.connector.offload(seq, preempted=False)
        self.connector.abort(seq)  # drops a load still in flight
        self.bm.free(seq)

    def check_integrity(self) -> None:
        """Held wave members are running and have exactly their last prompt token left."""
        running = {s.seq_id: s for s in self.running}
        for sid in self._held:
            seq = running.get(sid)
            if seq is None or seq.num_pending_tokens != 1:
                raise RuntimeError(f"scheduler: held {sid} is not a running sequence with one token left")

    def stats(self) -> object | None:
        """The scheduling policy's own counters (a stats dataclass), if it has any."""
        return None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        victim = self.admission.room_victim(self.running)
        if victim is not None:  # swapped to host; restored when room returns
            self._preempt(victim)
            out.preempted.append(victim)
        limit = self.config.max_num_batched_tokens
        decoding = [s for s in self.running if s.num_pending_tokens == 1 and s.seq_id not in self._held]
        self._wave = self.step_budget.slo_ms > 0 and not decoding
        self._releasing = self._wave and bool(self.running) and len(self._held) == len(self.running)
        if self._releasing:
            decoding, self._held = list(self.running), set()
        self._prefill_cap = self.step_budget.prefill_tokens(len(decoding), limit)
        if self._catch_up(decoding):
            self._prefill_cap = 0
        budget = self._schedule_running(out, limit)
        self._admit(out, min(budget, self._prefill_cap))
        # Keep decodes (single-token chunks) at the front: the runner batches them together.
        out.scheduled.sort(key=lambda s: s.num_tokens > 1)
        return out

    def _catch_up(self, decoding: list[Sequence]) -> bool:
        """Under an ITL SLO, whether this step runs the decodes alone because a stream's
        newest token was held back (half a character, a possible stop string): its client
        has waited a whole step already, and a full step more would make its visible gap
        two steps. Without this, the ~1.2 % of SmolLM2's tokens that end inside a
        character put the p99 gap at twice the step. Never two such steps in a row, so
        prefills keep moving while a stream emits characters of several tokens each."""
        held = self.step_budget.slo_ms > 0 and not self._caught_up and any(s.text_held for s in decoding)
        self._caught_up = held
        return held

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first (protects inter-token latency from long prefills); returns the budget left."""
        scheduled_ids: set[str] = set()
        for seq in sorted(self.running, key=lambda s: s.num_pending_tokens > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in self._held:
                continue  # preempted earlier in this loop, or waiting for its wave's release
            n = self._chunk(seq, budget)
            if n == 0:
                continue  # a prefill past this step's cap
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
        return budget

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: all pending ones within the budget; a prefill
        also within what is left of the step's prefill cap (taken from it)."""
        n = min(seq.num_pending_tokens, budget)
        if n > 1:
            n = min(n, self._prefill_cap)
            if self._holds_last(n, seq.num_pending_tokens, len(self.running), len(self.waiting)):
                n -= 1
                self._held.add(seq.seq_id)
            self._prefill_cap -= n
        return n

    def _holds_last(self, n: int, pending: int, members: int, queued: int) -> bool:
        """Whether a chunk of `n` of a sequence's `pending` tokens keeps its last one back:
        in a wave of `members` (this one included; not its release step), when the chunk
        would end the prompt while another member or one of `queued` waiting sequences
        that may still join would otherwise prefill beside this one's decodes."""
        if not self._wave or self._releasing or n < 2 or n != pending:
            return False
        return members > 1 or self._joinable(members, queued)

    def _joinable(self, members: int, queued: int) -> bool:
        """Whether one of `queued` waiting sequences may join a wave of `members`."""
        return (queued > 0 and members < self.config.max_num_seqs
                and self.step_budget.wave_admits(members))

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # Admitting while preempting would only thrash.
        while (
            budget > 0
            and self.waiting
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
            and not self._releasing  # the new batch size's decode step is not measured yet
            and (self.step_budget.admits(len(self.running)) or (
                self._wave and self._joinable(len(self.running), len(self.waiting))))
        ):
            seq = self.admission.head(self.waiting)
            match = self.bm.lookup(seq)
            # Keep one free block per running sequence, so admitting does not force the
            # next decode step straight into preemption.
            reserve = len(self.running)
            if not self.admission.has_room(seq, match, reserve, self.running):
                if self.admission.on_no_room(seq, self.waiting, reserve, self.running):
                    continue  # another request that fits now is the head
                break  # waits for room
            if self._stage(seq, match):
                continue  # out of the queue until its blocks arrive
            pending = len(seq) - len(match.block_ids) * self.bm.block_size
            n = min(pending, budget)
            hold = self._holds_last(n, pending, len(self.running) + 1, len(self.waiting) - 1)
            n -= hold
            if not self.bm.can_admit(seq, match, n, reserve=reserve):
                break
            del self.waiting[seq.seq_id]
            if hold:
                self._held.add(seq.seq_id)
            self._prefill_cap -= n if n > 1 else 0
            self.bm.admit(seq, match)
            if seq.num_preemptions == 0 and not seq.num_output_tokens:
                seq.num_cached_tokens = seq.num_computed_tokens
            if not self.bm.ensure_slots(seq, n):  # can_admit guaranteed the blocks
                raise RuntimeError("scheduler: admission lost its blocks")
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _stage(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Connector hook at admission: True when a tier load started (seq leaves the queue)."""
        _tokens, load_async = self.connector.get_num_matched(seq, match)
        if not (load_async and self.connector.start_load(seq, match)):
            return False
        del self.waiting[seq.seq_id]
        return True

    def _newest_unscheduled(self, scheduled_ids: set[str], exclude: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not exclude and seq.seq_id not in scheduled_ids and seq.block_table:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._held.discard(seq.seq_id)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.requeue_front(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Connector hook when a running sequence is preempted: copy out, then free."""
        self.connector.offload(seq, preempted=True)
        self.bm.free(seq)
