"""The ITL-SLO wave policy on its own: which members hold their last prompt token, when
they are released together, when admission may go on, and the catch-up step."""

import pytest

from tierguard.engine.api import SamplingParams
from tierguard.engine.sequence import Sequence
from tierguard.engine.slo_waves import SloWaves
from tierguard.engine.step_budget import StepBudget


def seq(sid: str, prompt: int = 10, computed: int = 0) -> Sequence:
    s = Sequence(sid, list(range(1, prompt + 1)), SamplingParams(max_tokens=4), arrival=0.0)
    s.num_computed_tokens = computed
    return s


def slo_budget(decode_ms: dict[int, float] | None = None) -> StepBudget:
    budget = StepBudget(0.0, slo_ms=20.0)
    budget.decode_ms = dict(decode_ms or {})
    return budget


class CountingBudget(StepBudget):
    """Counts `admits` calls (it has a side effect: the re-probe window)."""

    calls = 0

    def admits(self, num_running: int) -> bool:
        self.calls += 1
        return super().admits(num_running)


def test_without_an_slo_nothing_is_held_and_admission_is_the_budgets():
    waves, budget = SloWaves(max_num_seqs=8), StepBudget(0.0)
    budget.observe(1, 0, 0.001)  # a measured decode step: wave_admits would say yes with an SLO
    decoding, prefilling = seq("d", 4, computed=3), seq("p", 10, computed=0)
    assert waves.begin_step(budget, [decoding, prefilling]) == [decoding]
    assert waves.hold_last(budget, prefilling, 10, 10, members=2, queued=3) == 0
    decoding.text_held = True
    assert not waves.catch_up(budget, [decoding])
    assert waves.admits(budget, running=5, queued=3)  # no SLO: the budget always admits
    assert not waves.held
    waves.check_integrity([decoding, prefilling])


def test_a_wave_member_holds_the_last_token_only_of_a_chunk_that_ends_its_prompt():
    waves, budget = SloWaves(max_num_seqs=8), slo_budget({1: 5.0, 2: 6.0})
    a, b = seq("a", 30), seq("b", 12)
    assert waves.begin_step(budget, [a, b]) == []  # nothing decodes: a wave
    assert waves.hold_last(budget, a, 16, 30, members=2, queued=0) == 0  # the prompt goes on
    assert waves.hold_last(budget, b, 1, 1, members=2, queued=0) == 0  # one token: nothing to keep
    assert waves.hold_last(budget, b, 12, 12, members=2, queued=0) == 1
    assert waves.is_held(b) and not waves.is_held(a)
    b.num_computed_tokens = 11  # the chunk ran: its last token is left
    waves.check_integrity([a, b])


def test_a_lone_sequence_holds_only_while_one_from_the_queue_may_still_join():
    budget = slo_budget({1: 5.0})  # a wave of 2 decodes in ~10 ms <= 0.75 x 20 ms
    alone = seq("alone", 12)
    waves = SloWaves(max_num_seqs=8)
    waves.begin_step(budget, [alone])
    assert waves.hold_last(budget, alone, 12, 12, members=1, queued=0) == 0  # no one to wait for
    assert waves.hold_last(budget, alone, 12, 12, members=1, queued=1) == 1
    full = SloWaves(max_num_seqs=1)  # no slot for another member
    full.begin_step(budget, [alone])
    assert full.hold_last(budget, alone, 12, 12, members=1, queued=1) == 0
    slow = slo_budget({1: 9.0})  # 2 x 9 ms > 15 ms: the wave cannot grow
    waves = SloWaves(max_num_seqs=8)
    waves.begin_step(slow, [alone])
    assert waves.hold_last(slow, alone, 12, 12, members=1, queued=1) == 0


def test_the_release_step_hands_every_member_back_as_decoding_and_admits_no_one():
    waves, budget = SloWaves(max_num_seqs=8), CountingBudget(0.0, slo_ms=20.0)
    budget.decode_ms = {1: 5.0, 2: 6.0, 3: 7.0}
    a, b = seq("a", 8), seq("b", 9)
    waves.begin_step(budget, [a, b])
    assert waves.hold_last(budget, a, 8, 8, members=2, queued=1) == 1
    assert waves.hold_last(budget, b, 9, 9, members=2, queued=1) == 1
    a.num_computed_tokens, b.num_computed_tokens = 7, 8
    assert waves.admits(budget, running=2, queued=1)  # still forming
    # next step: every running sequence is a held member -> the release step
    assert waves.begin_step(budget, [a, b]) == [a, b]
    assert not waves.held and not waves.is_held(a)
    calls = budget.calls
    assert not waves.admits(budget, running=2, queued=1)
    assert budget.calls == calls  # the budget is not asked in a release step
    assert waves.hold_last(budget, a, 2, 2, members=2, queued=1) == 0  # nothing is held while releasing
    # after the release the members decode: no wave while anything decodes
    a.num_computed_tokens, b.num_computed_tokens = 8, 9
    a.token_ids.append(5)
    b.token_ids.append(5)
    c = seq("c", 6)
    assert waves.begin_step(budget, [a, b, c]) == [a, b]
    assert waves.hold_last(budget, c, 6, 6, members=3, queued=1) == 0


def test_in_a_wave_a_sequence_may_start_where_no_chunk_fits_beside_a_decode():
    budget = slo_budget({1: 5.0, 2: 6.0})
    budget.ms_per_prefill_token = 50.0  # a 4-token chunk (200 ms) never fits the 20 ms SLO
    assert not budget.admits(1)
    waves = SloWaves(max_num_seqs=3)
    a, b = seq("a", 8), seq("b", 8)
    waves.begin_step(budget, [a])  # nothing decodes: a wave
    assert waves.admits(budget, running=1, queued=1)  # 2 decodes in 6 ms <= 15 ms
    assert not waves.admits(budget, running=1, queued=0)  # no one to join
    assert not waves.admits(budget, running=3, queued=1)  # no sequence slot left
    a.num_computed_tokens = 8
    a.token_ids.append(5)
    waves.begin_step(budget, [a, b])  # a decodes: no wave, the budget alone decides
    assert not waves.admits(budget, running=2, queued=1)


def test_a_member_that_leaves_is_forgotten_and_a_stray_hold_is_an_integrity_error():
    waves, budget = SloWaves(max_num_seqs=8), slo_budget({1: 5.0})
    a, b = seq("a", 8), seq("b", 8)
    waves.begin_step(budget, [a, b])
    waves.hold_last(budget, a, 8, 8, members=2, queued=0)
    with pytest.raises(RuntimeError, match="held a is not a running sequence with one token left"):
        waves.check_integrity([a, b])  # its chunk has not run: 8 tokens left
    a.num_computed_tokens = 7
    waves.check_integrity([a, b])
    with pytest.raises(RuntimeError, match="held a"):
        waves.check_integrity([b])  # preempted or finished without forget()
    waves.forget(a)
    waves.check_integrity([b])


def test_a_held_token_makes_the_next_step_decodes_only_but_never_two_in_a_row():
    waves, budget = SloWaves(max_num_seqs=8), slo_budget({1: 5.0})
    d = seq("d", 4, computed=3)
    d.text_held = True
    decoding = waves.begin_step(budget, [d])
    assert waves.catch_up(budget, decoding)
    assert not waves.catch_up(budget, decoding)  # the step after a catch-up carries prefill
    assert waves.catch_up(budget, decoding)
    d.text_held = False
    assert not waves.catch_up(budget, decoding)
