"""Continuous batching: which sequences run this step, and how many tokens each.

A step's token budget (max_num_batched_tokens) is spent in this order:
  1. running sequences that decode (1 token each), oldest first;
  2. running sequences in the middle of a chunked prefill;
  3. waiting sequences, admitted while there is budget, a sequence slot (max_num_seqs)
     and KV blocks for their first chunk, in the order the admission policy gives.
When a running sequence cannot get a block, another running sequence (the newest one,
or the admission policy's choice) is preempted by recompute (its blocks are freed, it
goes back to the front of the queue; its full blocks stay in the prefix cache, so the
recompute is often cheap).

The scheduler decides; collaborators hold the policies, each called once per hook:
  - `step_budget` (step_budget.py): the prefill tokens (2 and 3) a step with decodes may
    take, so one prefill cannot stretch every stream's inter-token gap; under an ITL SLO
    also whether one more sequence may start (3 waits);
  - `waves` (slo_waves.py): under an ITL SLO, new sequences start decoding together;
  - `admission` (admission.py): which waiting request is next, whether it has room, and
    which running one yields room (FIFO without tiers, the cold contract's order with them);
  - `connector` (tierguard/kv/connector.py): stages a tier-resident prefix on admission
    (the sequence leaves the queue until the engine's poll hands it back) and copies out
    the full blocks of a sequence that leaves the device (finished or preempted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from tierguard.common.clock import SYSTEM_CLOCK, Clock
from tierguard.engine.admission import AdmissionPolicy, FifoAdmission
from tierguard.engine.block_manager import BlockManager, PrefixMatch
from tierguard.engine.config import EngineConfig
from tierguard.engine.sequence import ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus
from tierguard.engine.slo_waves import SloWaves
from tierguard.engine.step_budget import StepBudget
from tierguard.kv.connector import KVConnector, NoConnector


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 connector: KVConnector | None = None, admission: AdmissionPolicy | None = None,
                 step_budget: StepBudget | None = None, waves: SloWaves | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock  # queue times (admission aging); simulated time in tierguard/predict
        self.bm = block_manager
        self.connector = connector or NoConnector()
        self.admission = admission or FifoAdmission()
        self.waiting: OrderedDict[str, Sequence] = OrderedDict()  # front = next to admit
        self.running: list[Sequence] = []  # admission order, oldest first
        self.staging: dict[str, Sequence] = {}  # out of the queue until their tier load ends
        self.num_preemptions = 0
        self.step_budget = step_budget or StepBudget.from_config(config)
        self.waves = waves or SloWaves(config.max_num_seqs)
        self._prefill_cap = config.max_num_batched_tokens  # prefill tokens left in this step
        self._pins: dict[str, list[int]] = {}  # device prefixes of sequences set aside in _admit

    _held = property(lambda self: self.waves.held)  # the wave policy's held members, read-only

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.queued_at = self.clock.monotonic()
        self.waiting[seq.seq_id] = seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requeue_front(self, seq: Sequence) -> None:
        """A preempted sequence, or one whose staged load ended, goes back to the head of the queue."""
        self.staging.pop(seq.seq_id, None)
        self.add(seq)
        self.waiting.move_to_end(seq.seq_id, last=False)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        self.waves.forget(seq)
        self.staging.pop(seq.seq_id, None)
        if self.waiting.pop(seq.seq_id, None) is None and seq in self.running:
            self.running.remove(seq)
            self.connector.offload(seq, preempted=False)
        self.connector.abort(seq)  # drops a load still in flight
        self.bm.free(seq)

    def check_integrity(self) -> None:
        """The collaborators' invariants over the running set (held wave members)."""
        self.waves.check_integrity(self.running)

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
        decoding = self.waves.begin_step(self.step_budget, self.running)
        catch_up = self.waves.catch_up(self.step_budget, decoding)  # decodes alone this step
        self._prefill_cap = 0 if catch_up else self.step_budget.prefill_tokens(len(decoding), limit)
        budget = self._schedule_running(out, limit)
        self._admit(out, min(budget, self._prefill_cap))
        # Keep decodes (single-token chunks) at the front: the runner batches them together.
        out.scheduled.sort(key=lambda s: s.num_tokens > 1)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes first (protects inter-token latency from long prefills); within them,
        those the policy would preempt last go first, so that the one it would preempt
        first is the one left without a block. Returns the budget left."""
        scheduled_ids: set[str] = set()
        order = self.admission.preempt_order(self.running[::-1])[::-1]
        for seq in sorted(order, key=lambda s: s.num_pending_tokens > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self.waves.is_held(seq):
                continue  # preempted earlier in this loop, or waiting for its wave's release
            n = self._chunk(seq, budget)
            if n == 0:
                continue  # a prefill past this step's cap
            while not self.bm.ensure_slots(seq, n):
                victim = self._victim(scheduled_ids, seq)
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
            n -= self.waves.hold_last(self.step_budget, seq, n, seq.num_pending_tokens, len(self.running),
                                      len(self.waiting))
            self._prefill_cap -= n
        return n

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences. Beside decodes, a prefill that the admission policy
        `holds` waits for companions still staging or queued (they prefill together next
        step: each decoding stream pays one prefill gap, not one per arrival); it is set
        aside during a first pass so that the companions behind it start their loads."""
        aside: dict[str, Sequence] | None = {} if any(s.num_tokens == 1 for s in out.scheduled) else None
        budget = self._admit_pass(out, budget, aside)
        if not aside:
            return
        held = {k: s for k, s in aside.items() if self.admission.holds(s, self.waiting, self.staging)}
        self._to_front([s for k, s in aside.items() if k not in held])
        self._admit_pass(out, budget, None, held)
        self._to_front(list(held.values()))

    def _to_front(self, seqs: list[Sequence]) -> None:
        """Back to the head of the queue, in order, with their pinned prefixes released."""
        for seq in reversed(seqs):
            self.bm.unpin(self._pins.pop(seq.seq_id, []))
            self.waiting[seq.seq_id] = seq
            self.waiting.move_to_end(seq.seq_id, last=False)

    def _admit_pass(
        self, out: SchedulerOutput, budget: int, aside: dict[str, Sequence] | None,
        held: dict[str, Sequence] | None = None,
    ) -> int:
        """One admission loop; with `aside`, ready prefills the policy may hold are moved
        there instead of admitted. The policy sees set-aside and `held` sequences as
        staging (out of the queue, coming back): their room is not another's to take.
        Returns the budget left."""
        # Admitting while preempting would only thrash.
        while (
            budget > 0
            and self.waiting
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
            and self.waves.admits(self.step_budget, len(self.running), len(self.waiting))
        ):
            seq = self.admission.head(self.waiting)
            match = self.bm.lookup(seq)
            # Keep one free block per running sequence, so admitting does not force the
            # next decode step straight into preemption.
            reserve = len(self.running)
            parked = aside or held
            staging = {**self.staging, **parked} if parked else self.staging
            if not self.admission.has_room(seq, match, reserve, self.running, staging):
                if self.admission.on_no_room(seq, self.waiting, reserve, self.running, staging):
                    continue  # another request that fits now is the head
                break  # waits for room
            if self._stage(seq, match):
                continue  # out of the queue until its blocks arrive
            pending = len(seq) - len(match.block_ids) * self.bm.block_size
            if aside is not None and pending > 1 and self.admission.may_hold(seq):
                # Pinned while set aside: a companion's load or admission must not evict it.
                self._pins[seq.seq_id] = self.bm.pin(match)
                del self.waiting[seq.seq_id]
                aside[seq.seq_id] = seq
                continue
            n = min(pending, budget)
            n -= self.waves.hold_last(self.step_budget, seq, n, pending, len(self.running) + 1,
                                      len(self.waiting) - 1)
            if not self.bm.can_admit(seq, match, n, reserve=reserve):
                self.waves.forget(seq)
                break
            del self.waiting[seq.seq_id]
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
        return budget

    def _stage(self, seq: Sequence, match: PrefixMatch) -> bool:
        """Connector hook at admission: True when a tier load started (seq leaves the queue)."""
        _tokens, load_async = self.connector.get_num_matched(seq, match)
        if not (load_async and self.connector.start_load(seq, match)):
            return False
        del self.waiting[seq.seq_id]
        self.staging[seq.seq_id] = seq
        return True

    def _unscheduled(self, scheduled_ids: set[str], exclude: Sequence) -> Iterator[Sequence]:
        """Running sequences holding blocks and not scheduled in this step, newest first."""
        return (s for s in reversed(self.running) if s is not exclude and s.seq_id not in scheduled_ids and s.block_table)

    def _newest_unscheduled(self, scheduled_ids: set[str], exclude: Sequence) -> Sequence | None:
        return next(self._unscheduled(scheduled_ids, exclude), None)

    def _victim(self, scheduled_ids: set[str], seq: Sequence) -> Sequence:
        """Who gives up its blocks when `seq` cannot grow: the admission policy's first
        choice among the unscheduled running sequences (newest first) and `seq` itself (last)."""
        return self.admission.preempt_order([*self._unscheduled(scheduled_ids, seq), seq])[0]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.waves.forget(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.requeue_front(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        """Connector hook when a running sequence is preempted: copy out, then free."""
        self.connector.offload(seq, preempted=True)
        self.bm.free(seq)
