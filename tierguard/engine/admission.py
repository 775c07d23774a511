"""Admission policies: which waiting request is next, whether it has room, who yields room.

The scheduler calls one policy method per hook and keeps no policy of its own:

    head(waiting)                          the request to try next
    has_room(seq, match, reserve, running, staging)
                                           may it be admitted now (before its first chunk
                                           is checked against the pool)
    on_no_room(head, waiting, ...)         it has no room: True when another request was
                                           moved to the front instead (try again)
    may_hold(seq) / holds(seq, waiting, staging)
                                           a ready prefill beside decodes waits this step
                                           for companions (it is set aside while they are
                                           tried, then `holds` decides)
    room_victim(running)                   at the start of a step: a running sequence to
                                           swap out so a waiting one gets room
    preempt_order(candidates)              a running sequence cannot grow: who goes first

`FifoAdmission` is nano-vllm's: strict arrival order, room for the first chunk only.
`ContractAdmission` is used with tiers and applies the cold contract's class order
(tierguard/kv/contract.py) with the block manager's facts:
  - room for the whole remaining prompt plus the unfinished prefills of running
    sequences (a long request waits for room instead of thrashing the pool);
  - an interactive request within LOOKAHEAD goes before batch ones still within their
    TTFT budget; past its budget a request is overtaken by no one (nothing starves);
  - while the head waits for room within its budget, a smaller request that fits may
    pass it; an interactive head that waits makes the newest running batch sequence
    yield its room at the next step (swapped to host RAM, restored later); when the
    pool runs dry under running sequences, a batch one is the victim before an
    interactive one (newest first within a class);
  - while an interactive request stages its prefix from a tier (out of the queue until
    its blocks arrive), no batch request within its budget is admitted: the room it
    yielded or found would otherwise go to the batch one, and its return would swap that
    one out again (a swap-out, a reload and one more gap in its stream for nothing);
  - an interactive request ready to prefill beside decodes waits, at most HOLD_STEPS
    steps, while another interactive request stages or queues: requests that arrive
    together but are ready a step apart (one prefix on the device, another loading from
    a tier, a third waiting for a swap-out to free room) would otherwise run their
    prefills in separate steps, and each such step is a prefill-sized gap in every
    decoding stream. Sharing one step costs the ready ones a decode step or two of TTFT.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice

from tierguard.common.clock import SYSTEM_CLOCK, Clock
from tierguard.engine.block_manager import BlockManager, PrefixMatch
from tierguard.engine.sequence import Sequence
from tierguard.kv.contract import LOOKAHEAD, ColdContract

NONE_STAGING: Mapping[str, Sequence] = {}
HOLD_STEPS = 2  # steps a ready interactive prefill may wait for companions (ContractAdmission)


class AdmissionPolicy:
    """The scheduler's admission hooks; the defaults are FIFO with room for the first chunk.

    The scheduler calls them from the engine thread inside a step, so an implementation
    must answer from memory (no I/O, no waiting), must not allocate or free blocks, and
    must not change the queue or the running set except where a method says so. The
    scheduler keeps the mechanism: it checks the first chunk against the pool itself,
    removes an admitted sequence from `waiting` and preempts a victim it is given.
    """

    def head(self, waiting: OrderedDict[str, Sequence]) -> Sequence:
        """The waiting sequence to try next: one of `waiting`'s values (never empty)."""
        return next(iter(waiting.values()))

    def has_room(
        self, seq: Sequence, match: PrefixMatch, reserve: int, running: list[Sequence],
        staging: Mapping[str, Sequence] = NONE_STAGING,
    ) -> bool:
        """Whether `seq` (with its device prefix `match`) may be admitted now, keeping
        `reserve` blocks free for the `running` sequences; `staging`: sequences out of the
        queue until their tier load ends (they come back to the head of it). True promises
        no blocks: the scheduler still checks the first chunk against the pool and stops
        if it does not fit."""
        return True

    def on_no_room(
        self, head: Sequence, waiting: OrderedDict[str, Sequence], reserve: int, running: list[Sequence],
        staging: Mapping[str, Sequence] = NONE_STAGING,
    ) -> bool:
        """`head` has no room. True after moving another waiting request to the front of
        `waiting`: the scheduler asks `head` again within the same step, so True must mean
        that `head` now returns a different sequence. False ends admission for this step."""
        return False

    def may_hold(self, seq: Sequence) -> bool:
        """Whether `seq`, admissible now with a prefill to run beside this step's decodes,
        may be held: True sets it aside (out of the queue) while the scheduler tries the
        requests behind it, then asks `holds`. The default never holds."""
        return False

    def holds(self, seq: Sequence, waiting: OrderedDict[str, Sequence], staging: Mapping[str, Sequence]) -> bool:
        """`seq` was set aside by `may_hold`; True keeps it waiting this step (it returns
        to the front of the queue), False admits it in this step after all. `waiting` and
        `staging` are what is left once the others were tried (without `seq`). A policy
        that holds must bound how often, so that nothing waits forever."""
        return False

    def room_victim(self, running: list[Sequence]) -> Sequence | None:
        """At the start of a step: one of `running`, holding blocks, to preempt so that a
        waiting sequence gets room (it requeues at the front; its blocks go to host RAM
        through the connector), or None."""
        return None

    def preempt_order(self, candidates: list[Sequence]) -> list[Sequence]:
        """A running sequence cannot get a block: `candidates` are who may be preempted,
        the scheduler's order (newest other sequence first, the one that cannot grow
        last); returns them reordered, the victim first. The default keeps the order."""
        return candidates


class FifoAdmission(AdmissionPolicy):
    """Arrival order; the first chunk's blocks are the only room asked for."""


class ContractAdmission(AdmissionPolicy):
    """The cold contract's class order with the block manager's facts (module docstring)."""

    def __init__(self, block_manager: BlockManager, contract: ColdContract, clock: Clock = SYSTEM_CLOCK) -> None:
        self.bm = block_manager
        self.contract = contract
        self.clock = clock  # how long a request has queued (overdue); the engine's clock
        # An interactive request waits for room that a running batch sequence holds: the
        # next step swaps that sequence out (not this one: it may be in this step's batch).
        self._room_wanted = False

    def head(self, waiting: OrderedDict[str, Sequence]) -> Sequence:
        first = next(iter(waiting.values()))
        if self.contract.goes_first(first.request_class) or self._overdue(first):
            return first
        for seq in islice(waiting.values(), 1, 1 + LOOKAHEAD):
            if self.contract.goes_first(seq.request_class):
                return seq
        return first

    def has_room(
        self, seq: Sequence, match: PrefixMatch, reserve: int, running: list[Sequence],
        staging: Mapping[str, Sequence] = NONE_STAGING,
    ) -> bool:
        """Room for the whole remaining prompt, after the unfinished prefills of running
        ones; none for a batch request while an interactive one stages (module docstring)."""
        if (
            self.contract.yields_room(seq.request_class)
            and not self._overdue(seq)
            and any(self.contract.goes_first(s.request_class) for s in staging.values())
        ):
            return False
        whole = len(seq) - len(match.block_ids) * self.bm.block_size
        pending = sum(
            self.bm.blocks_needed(s, s.num_pending_tokens) for s in running if s.num_pending_tokens > 1
        )
        return self.bm.can_admit(seq, match, whole, reserve=reserve + pending)

    def on_no_room(
        self, head: Sequence, waiting: OrderedDict[str, Sequence], reserve: int, running: list[Sequence],
        staging: Mapping[str, Sequence] = NONE_STAGING,
    ) -> bool:
        if not self._overdue(head):
            urgent = self.contract.goes_first(head.request_class)
            for cand in islice(waiting.values(), 0, 1 + LOOKAHEAD):
                if cand is head or len(cand) >= len(head):
                    continue
                # A head that goes first is passed only by one that goes first too: a batch
                # request would take the room it waits for (and `head` would pick it again).
                if urgent and not self.contract.goes_first(cand.request_class):
                    continue
                if self.has_room(cand, self.bm.lookup(cand), reserve, running, staging):
                    waiting.move_to_end(cand.seq_id, last=False)
                    return True
        self._room_wanted = self.contract.goes_first(head.request_class)
        return False

    def may_hold(self, seq: Sequence) -> bool:
        return (
            self.contract.goes_first(seq.request_class) and seq.num_holds < HOLD_STEPS and not self._overdue(seq)
        )

    def holds(self, seq: Sequence, waiting: OrderedDict[str, Sequence], staging: Mapping[str, Sequence]) -> bool:
        """While another interactive request stages or queues (module docstring)."""
        others = (*staging.values(), *islice(waiting.values(), 0, 1 + LOOKAHEAD))
        if not any(self.contract.goes_first(s.request_class) for s in others):
            return False
        seq.num_holds += 1
        return True

    def room_victim(self, running: list[Sequence]) -> Sequence | None:
        if not self._room_wanted:
            return None
        self._room_wanted = False
        for seq in reversed(running):
            if self.contract.yields_room(seq.request_class) and seq.block_table:
                return seq
        return None

    def preempt_order(self, candidates: list[Sequence]) -> list[Sequence]:
        return sorted(candidates, key=lambda s: not self.contract.yields_room(s.request_class))

    def _overdue(self, seq: Sequence) -> bool:
        return self.contract.overdue(seq.request_class, seq.queued_at, self.clock.monotonic())
