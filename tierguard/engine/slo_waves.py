"""Waves under an inter-token latency SLO (`--itl-slo-ms`): when new sequences start decoding.

When no running sequence decodes, the batch fills as a wave: while a decode step at the
wave's size stays within the SLO's share (`StepBudget.wave_admits`), more waiting
sequences join; their prefills run in steps with no decode beside them (so no SLO caps
them), and each member keeps its last prompt token back until every member is ready.
One release step then computes those tokens, and all members start decoding together.
Why: where a prefill chunk does not fit beside the decodes within the SLO, admission
would start one sequence at a time (its prefill alone, then its decode alone); a wave
pays the same prefills but decodes its members in one batch.

Also under an SLO: when a decoding stream's newest token showed no text (half a
character, a possible stop string), the next step runs the decodes alone (`catch_up`),
never two such steps in a row.

The scheduler calls one method per hook and keeps no wave state of its own:

    begin_step(budget, running)            once per step, first: the sequences that decode
    catch_up(budget, decoding)             once per step: this step runs the decodes alone
    is_held(seq)                           a held member computes nothing this step
    hold_last(budget, seq, n, ...)         a prefill chunk keeps its last token back
    admits(budget, running, queued)        whether a waiting sequence may start
    forget(seq)                            a sequence left the running set (finished,
                                           aborted or preempted), or its chunk that
                                           `hold_last` held was not scheduled

What the caller may assume: without an SLO (`budget.slo_ms == 0`) nothing is held,
`catch_up` is False, `admits` is `budget.admits`, and `begin_step` returns the running
sequences with one token left; a release step hands every member back as decoding at
once and admits no one. With the calls above, a held member is always running with
exactly its last prompt token pending (`check_integrity` raises otherwise). The budget
is passed on each call, so the caller may replace its `StepBudget` between steps.
"""

from __future__ import annotations

from tierguard.engine.sequence import Sequence
from tierguard.engine.step_budget import StepBudget


class SloWaves:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.held: set[str] = set()  # wave members whose last prompt token waits for release
        self._wave = False  # this step: an SLO is set and no running sequence decodes
        self._releasing = False  # this step: every running sequence is a held member
        self._caught_up = False  # the last step ran decodes alone for a held token

    def begin_step(self, budget: StepBudget, running: list[Sequence]) -> list[Sequence]:
        """The running sequences that decode this step (one token left, not held); in a
        release step, every member (their held tokens are computed now)."""
        decoding = [s for s in running if s.num_pending_tokens == 1 and s.seq_id not in self.held]
        self._wave = budget.slo_ms > 0 and not decoding
        self._releasing = self._wave and bool(running) and len(self.held) == len(running)
        if self._releasing:
            decoding, self.held = list(running), set()
        return decoding

    def catch_up(self, budget: StepBudget, decoding: list[Sequence]) -> bool:
        """Whether this step runs the decodes alone because a stream's newest token was
        held back (no text yet): its client has waited a whole step already, and a full
        step more would make its visible gap two steps, which sets the p99 gap. Never two
        such steps in a row, so prefills keep moving while a stream emits characters of
        several tokens each."""
        held = budget.slo_ms > 0 and not self._caught_up and any(s.text_held for s in decoding)
        self._caught_up = held
        return held

    def is_held(self, seq: Sequence) -> bool:
        return seq.seq_id in self.held

    def forget(self, seq: Sequence) -> None:
        self.held.discard(seq.seq_id)

    def hold_last(
        self, budget: StepBudget, seq: Sequence, n: int, pending: int, members: int, queued: int
    ) -> int:
        """Tokens (1 or 0) that a chunk of `n` of `seq`'s `pending` tokens keeps back; a
        kept one makes `seq` a held member (`forget` it if the chunk is not scheduled).
        A member holds in a wave of `members` (this one included; not its release step)
        when the chunk would end the prompt while another member, or one of `queued`
        waiting sequences that may still join, would otherwise prefill beside its decodes."""
        if not self._wave or self._releasing or n < 2 or n != pending:
            return 0
        if members > 1 or self._joinable(budget, members, queued):
            self.held.add(seq.seq_id)
            return 1
        return 0

    def admits(self, budget: StepBudget, running: int, queued: int) -> bool:
        """Whether a waiting sequence may start beside `running` ones (`queued` waiting):
        what `budget.admits` says, or, in a wave, whether one more member fits
        (`budget.wave_admits`); never in a release step, where the new batch size's
        decode step is not measured yet (and `budget.admits` is then not asked)."""
        if self._releasing:
            return False
        return budget.admits(running) or (self._wave and self._joinable(budget, running, queued))

    def _joinable(self, budget: StepBudget, members: int, queued: int) -> bool:
        return queued > 0 and members < self.max_num_seqs and budget.wave_admits(members)

    def check_integrity(self, running: list[Sequence]) -> None:
        """Held wave members are running and have exactly their last prompt token left."""
        by_id = {s.seq_id: s for s in running}
        for sid in self.held:
            seq = by_id.get(sid)
            if seq is None or seq.num_pending_tokens != 1:
                raise RuntimeError(f"scheduler: held {sid} is not a running sequence with one token left")
