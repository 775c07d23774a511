"""The tiered KV store wired into the engine: same greedy outputs with tiers on and off,
swap to host and back, prefix reload from host and from disk, the decode guard, naive mode."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import batch_then_chats, make_engine, prompt_ids
from tests.engine.guard_spy import GuardSpy
from tierguard.common.errors import TierguardError
from tierguard.engine.api import SamplingParams
from tierguard.engine.prefix_hash import prefix_block_hashes
from tierguard.engine.sequence import SequenceStatus
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import ColdContractViolation, decode_guard

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt_ids(100 + i, 36 + 9 * i) for i in range(5)]
TIGHT = 48  # blocks of 4 tokens: too few for the five sequences at once


def run(engine, prompts, params=GREEDY, check=True) -> list[list[int]]:
    """Drive the engine step by step, checking pool integrity after every step."""
    ids = [f"q{engine.step_count}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if check:
            engine.check_integrity()
    return [out[rid] for rid in ids]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run(make_engine(tiny_dir), PROMPTS)


def extra(engine) -> dict[str, float]:
    return engine.stats().flat()


def test_swap_to_host_and_back_keeps_greedy_outputs(tiny_dir, reference):
    engine = make_engine(tiny_dir, num_blocks=TIGHT, kv_host_gib=0.01)
    try:
        assert run(engine, PROMPTS) == reference
        x = extra(engine)
        assert engine.stats().num_preemptions > 0
        assert x["kv_swap_out_blocks"] > 0  # preempted state went to host RAM
        assert x["kv_blocks_loaded"] > 0 and x["kv_host_hits"] > 0  # and came back from it
        assert x["kv_loading_seqs"] == 0
    finally:
        engine.close()
    engine.check_integrity()


def test_prefix_reload_from_host(tiny_dir, reference):
    engine = make_engine(tiny_dir, kv_host_gib=0.01)
    try:
        assert run(engine, PROMPTS[:2]) == reference[:2]
        engine.pool.evict_all_cached()  # the device forgets; host RAM still has the blocks
        before = extra(engine)["kv_host_hits"]
        assert run(engine, PROMPTS[:2]) == reference[:2]
        assert extra(engine)["kv_host_hits"] > before
    finally:
        engine.close()


def test_stores_dropped_under_backpressure_break_nothing(tiny_dir, reference, tmp_path):
    """A store lane with almost no share of the cores and room for one store: finished
    sequences' stores are dropped and counted, while swap-outs and loads (promotions)
    still run, outputs stay greedy-exact and the pool stays consistent."""
    tiers = dict(kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    engine = make_engine(tiny_dir, num_blocks=TIGHT, kv_store_share=0.01, kv_store_max_pending=1, **tiers)
    try:
        engine.connector.store_policy.charge(0.02)  # the lane's share is spent for ~2 s
        assert run(engine, PROMPTS) == reference
        x = extra(engine)
        assert x["kv_stores_dropped_offload_backlog"] > 0
        assert x["kv_stores_admitted_offload"] <= 1 + x["kv_stores_dropped_offload_backlog"]
        assert x["kv_swap_out_blocks"] > 0 and x["kv_host_hits"] > 0  # promotions ran
        assert x["kv_stores_pending"] <= 1
    finally:
        engine.close()
    engine.check_integrity()
    assert extra(engine)["kv_stores_pending"] == 0  # close ran what was queued


def test_a_finished_sequence_leaves_the_device_while_write_behind_waits(tiny_dir, reference, tmp_path):
    """The stores' share is spent: writing to disk waits, but the offload to host RAM, which
    holds device blocks until it ends, still runs, so those blocks are free again and the
    prefix comes back from host RAM."""
    import time

    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05,
                         kv_store_share=0.01)
    try:
        engine.connector.store_policy.charge(100.0)  # write-behind would wait hours

        def answer(rid: str) -> list[int]:  # until the request ends, not the tiers' writes
            engine.add_request(rid, PROMPTS[0], GREEDY)
            out: list[int] = []
            done, deadline = False, time.monotonic() + 30
            while not done and time.monotonic() < deadline:
                for o in engine.step():
                    out += o.new_token_ids
                    done = done or o.finished
            return out

        assert answer("first") == reference[0]
        deadline = time.monotonic() + 10
        while extra(engine)["kv_pinned_blocks"] > 0 and time.monotonic() < deadline:
            engine.step()
            time.sleep(0.005)
        x = extra(engine)
        assert x["kv_pinned_blocks"] == 0 and x["kv_offloaded_blocks"] > 0
        assert x["kv_persisted_blocks"] == 0  # the disk write is still waiting for its share
        engine.pool.evict_all_cached()
        assert answer("again") == reference[0]
        assert extra(engine)["kv_host_hits"] > 0
    finally:
        engine.close()


def test_prefix_reload_from_disk_after_restart(tiny_dir, tmp_path):
    # Its own one-prompt reference, not the module's: this test is the killer of three
    # mutants in tests/test_mutations.py, each run in a fresh process.
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reference = run(make_engine(tiny_dir), PROMPTS[:1], short)
    tiers = dict(kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    first = make_engine(tiny_dir, **tiers)
    assert run(first, PROMPTS[:1], short) == reference
    first.close()  # write-behind to disk finishes here
    assert extra(first)["kv_persisted_blocks"] > 0
    second = make_engine(tiny_dir, **tiers)  # a new process would see the same directory
    spy = GuardSpy(second)
    try:
        assert run(second, PROMPTS[:1], short) == reference
        # Every step scheduled and ran under the decode guard, and the disk was read only
        # on the transfer worker's threads (a counter of refused reads cannot show either).
        spy.assert_contract(read_media=("disk",))
        x = extra(second)
        assert x["kv_disk_hits"] > 0 and x["kv_blocks_loaded_from_disk"] > 0
        # bench/prefix_restart.py reads these names (its run is invalid without disk hits)
        assert {"kv_persisted_blocks", "kv_tier_recomputes"} <= x.keys()
    finally:
        second.close()


def test_decode_path_cannot_read_disk(tiny_dir, reference, tmp_path):
    """A workload staged from disk, with swaps to host RAM, while every step runs inside
    the decode guard: the reads happen (disk hits), none on the engine thread, and a read
    tried inside the guard is refused and counted."""
    tiers = dict(kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    first = make_engine(tiny_dir, **tiers)
    run(first, PROMPTS)
    first.close()
    engine = make_engine(tiny_dir, num_blocks=TIGHT, **tiers)
    try:
        disk = engine.connector.media["disk"]
        first_block = prefix_block_hashes(PROMPTS[0], 4, engine.block_manager.fingerprint)[0]
        assert disk.contains(first_block)
        with decode_guard(), pytest.raises(ColdContractViolation):
            disk.read(first_block)
        assert extra(engine)["kv_disk_reads_in_decode"] == 1  # the refused read is counted
        spy = GuardSpy(engine)
        assert run(engine, PROMPTS) == reference
        x = extra(engine)
        assert x["kv_disk_hits"] > 0 and x["kv_swap_out_blocks"] > 0
        assert x["kv_disk_reads_in_decode"] == 1  # and the engine added none
    finally:
        engine.close()
    spy.assert_contract(read_media=("disk",))
    for names, _reason in _bench_exercised()["contract"]:  # the bench's validity counters exist
        assert all(n in x for n in names) and any(x[n] > 0 for n in names), names


def test_naive_mode_reads_disk_inside_the_step_and_counts_it(tiny_dir, reference, tmp_path):
    engine = make_engine(
        tiny_dir,
        num_blocks=40,
        kv_host_gib=0.001,
        kv_disk_dir=str(tmp_path),
        kv_disk_gib=0.05,
        naive_sync_disk=True,
    )
    try:
        spill = engine.scheduler.pager.disk.disk
        spy = GuardSpy(engine, extra=(("naive.read_many", spill, "read_many"),))
        assert run(engine, PROMPTS) == reference
        x = extra(engine)
        assert x["kv_naive_page_outs"] > 0 and x["kv_naive_page_ins"] > 0
        assert x["kv_naive_sync_reads"] > 0
        assert x["kv_naive_reads_in_decode"] >= x["kv_naive_sync_reads"]
        assert x["kv_naive_paged_out_seqs"] == 0
    finally:
        engine.close()
    # The naive mode reads its spill tier on the engine thread inside the step, and the
    # spy sees exactly that (so its silence in the contract's tests means something);
    # the production disk tier is never read on the engine thread.
    engine_thread = spy.engine_thread()
    naive = spy.calls.pop("naive.read_many")
    assert naive and all(c.thread == engine_thread and c.depth >= 1 for c in naive)
    assert spill.stats().reads_in_decode == x["kv_naive_reads_in_decode"] >= len(naive)
    spy.assert_contract()
    # The counters the benchmark's validity check requires exist under these names.
    for names, _reason in _bench_exercised()["naive"]:
        assert all(n in x for n in names) and any(x[n] > 0 for n in names), names


def test_naive_sync_disk_stalls_decode_once_concurrency_outgrows_the_pool(tiny_dir, reference, tmp_path):
    """The small version of the demo's "naive sync-disk lowers the boundary" (slow:
    tests/sweep/test_demo_e2e.py): the same small pool and workload at concurrency 1 and
    5, naive mode against the cold contract. At 1 the pool holds the sequence and neither
    reads the disk; at 5 the naive mode reads it inside decode steps (every stream of
    the step waits on it), while the contract never does and stops admitting instead. A
    boundary (the highest concurrency whose steps meet the SLO) can then only be lower
    for the naive mode; how much lower is the demo's measurement."""
    tiers = dict(num_blocks=40, kv_host_gib=0.001, kv_disk_gib=0.05)
    seen = {}
    for naive in (True, False):
        for c in (1, 5):
            engine = make_engine(tiny_dir, kv_disk_dir=str(tmp_path / f"{naive}-{c}"), naive_sync_disk=naive, **tiers)
            try:
                spy = GuardSpy(engine)
                outs = [out for i in range(0, 5, c) for out in run(engine, PROMPTS[i : i + c])]
                assert outs == reference  # same tokens either way
                x = extra(engine)
            finally:
                engine.close()
            seen[naive, c] = x.get("kv_naive_reads_in_decode", 0)
            if not naive:
                spy.assert_contract()
                assert x.get("kv_disk_reads_in_decode", 0) == 0
    assert seen[True, 1] == 0 and seen[True, 5] > 0, seen
    assert seen[False, 1] == seen[False, 5] == 0, seen


def test_long_request_waits_for_room_instead_of_thrashing(tiny_dir):
    """With tiers, admission needs room for the whole prompt: a long prompt waits while
    short ones run, and no sequence is preempted to make room for it."""
    engine = make_engine(tiny_dir, num_blocks=40, kv_host_gib=0.01, max_num_batched_tokens=16)
    try:
        short = [prompt_ids(7 + i, 12) for i in range(3)]
        long = prompt_ids(99, 120)
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.add_request("long", long, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.step()
        assert engine.seqs["long"].status is SequenceStatus.WAITING
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        assert engine.stats().num_preemptions == 0
    finally:
        engine.close()


def test_bad_tier_settings_are_refused(tiny_dir, tmp_path):
    with pytest.raises(TierguardError, match="kv-disk-dir"):
        make_engine(tiny_dir, kv_disk_gib=1.0)
    with pytest.raises(TierguardError, match="naive"):
        make_engine(tiny_dir, kv_host_gib=0.01, naive_sync_disk=True)


def test_interactive_request_swaps_a_running_batch_one_to_host(tiny_dir):
    """A batch request holds most of the pool; interactive ones that do not fit make the
    scheduler swap it out to host RAM; it is restored later and every output is exact."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    long, shorts = prompt_ids(77, 100), [prompt_ids(80 + i, 40) for i in range(2)]
    expected = make_engine(tiny_dir).generate([long, *shorts], params)
    engine = make_engine(tiny_dir, num_blocks=48, kv_host_gib=0.01)
    try:
        out: dict[str, list[int]] = {"batch": [], "i0": [], "i1": []}
        engine.add_request("batch", long, params, request_class="batch")
        for step in range(10_000):
            if step == 3:  # the batch request is decoding by now
                for i, p in enumerate(shorts):
                    engine.add_request(f"i{i}", p, params)
            elif step > 3 and not engine.has_unfinished():
                break
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            engine.check_integrity()
        assert [out["batch"], out["i0"], out["i1"]] == expected
        assert engine.stats().num_preemptions >= 1
        assert extra(engine)["kv_swap_out_blocks"] > 0
    finally:
        engine.close()


def _batch_then_chat(engine, long, chat, params, on_chat=lambda: None) -> tuple[dict, list[str]]:
    """Run a batch request, add an interactive one ("chat") at step 3 (after `on_chat()`),
    run both to the end. Returns their outputs and the preempted request ids in order."""
    victims: list[str] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: victims.append(seq.seq_id) or preempt(seq)
    return batch_then_chats(engine, long, {"chat": chat}, params, on_chat=on_chat), victims


def test_a_batch_request_that_yielded_room_waits_while_the_interactive_one_stages(tiny_dir):
    """An interactive request whose prefix is in host RAM only makes a running batch
    request yield its room, then stages its prefix (out of the queue for a while: the copy
    is slowed here). The batch request must not take the room back meanwhile: the
    interactive one's return would swap it out a second time, one more gap in its stream."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    chat, long = prompt_ids(80, 40), prompt_ids(77, 100)
    turn = chat + prompt_ids(81, 8)
    expected = make_engine(tiny_dir).generate([long, turn], params)
    faults = FaultInjector()
    engine = make_engine(tiny_dir, faults=faults, num_blocks=36, kv_host_gib=0.01)
    try:
        run(engine, [chat], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.pool.evict_all_cached()  # the chat's prefix is in host RAM only
        # At the chat's arrival the batch request decodes and holds most of the pool; the
        # batch one's swap-out and the chat's load are slowed.
        out, victims = _batch_then_chat(engine, long, turn, params, lambda: faults.delay("transfer", 0.05, times=2))
        assert [out["batch"], out["chat"]] == expected
        assert extra(engine)["kv_host_hits"] >= 10  # the chat's prefix came back from host RAM
        assert victims == ["batch"], victims
    finally:
        engine.close()


def test_a_pool_that_runs_dry_under_running_sequences_preempts_the_batch_one(tiny_dir):
    """A batch and an interactive request both decode and the pool runs out: the batch
    one gives up its blocks first (swapped to host RAM), not the interactive one (which
    would come back and make the batch one yield anyway: two preemptions for one)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    long, chat = prompt_ids(77, 100), prompt_ids(80, 40)
    expected = make_engine(tiny_dir).generate([long, chat], params)
    engine = make_engine(tiny_dir, num_blocks=44, kv_host_gib=0.01)
    try:
        out, victims = _batch_then_chat(engine, long, chat, params)  # both fit at admission; their answers do not
        assert [out["batch"], out["chat"]] == expected
        assert victims[:1] == ["batch"], victims
    finally:
        engine.close()


def test_a_waiting_interactive_request_is_not_overtaken_by_a_smaller_batch_one(tiny_dir):
    """An interactive request that waits for room is not passed by a smaller batch request
    that would fit (the class order holds), and admission ends its turn instead of trying
    the same two again until the head is overdue: the batch one that runs is swapped out
    for it."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    running, big_batch, interactive, small_batch = (prompt_ids(60 + i, n) for i, n in enumerate((100, 100, 100, 12)))
    expected = make_engine(tiny_dir).generate([running, big_batch, interactive, small_batch], params)
    engine = make_engine(tiny_dir, num_blocks=48, kv_host_gib=0.01)
    try:
        out: dict[str, list[int]] = {"run": [], "b": [], "i": [], "s": []}
        first_token: list[str] = []
        admission, tries = engine.scheduler.admission, []
        on_no_room = admission.on_no_room
        admission.on_no_room = lambda *a: tries.append(1) or on_no_room(*a)
        engine.add_request("run", running, params, request_class="batch")
        for step in range(10_000):
            if step == 3:  # "run" holds most of the pool by now
                engine.add_request("b", big_batch, params, request_class="batch")
                engine.add_request("i", interactive, params, request_class="interactive")
                engine.add_request("s", small_batch, params, request_class="batch")
            elif step > 3 and not engine.has_unfinished():
                break
            tries.clear()
            outputs = engine.step()
            assert len(tries) <= 2, f"admission tried {len(tries)} times in one step"
            for o in outputs:
                if o.new_token_ids and not out[o.request_id]:
                    first_token.append(o.request_id)
                out[o.request_id].extend(o.new_token_ids)
            engine.check_integrity()
        assert [out["run"], out["b"], out["i"], out["s"]] == expected
        assert first_token.index("i") < first_token.index("s"), first_token
    finally:
        engine.close()


def _bench_exercised() -> dict:
    """bench/tier_scenario.py's EXERCISED table: the counters a valid benchmark run must
    show. Checked against the engine's own names, so a rename makes the bench invalid here
    first, not silently in a benchmark."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    spec = importlib.util.spec_from_file_location("tier_scenario_for_tests", bench / "tier_scenario.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module.EXERCISED
