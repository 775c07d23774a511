"""The routing policy and the prefix index: pure modules, driven with made-up loads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierguard.gate.prefix_index import PrefixIndex, render_chat, render_prompt
from tierguard.gate.routing import (
    LeastLoaded,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    RouteRequest,
    make_router,
)
from tierguard.gate.upstreams import queue_depth


def _chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You answer questions about the attached manual. " * 8}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i}: " + "why does the pump stall? " * 12})
        msgs.append({"role": "assistant", "content": f"answer {i}: " + "check the valve. " * 12})
    return msgs


def test_chained_keys_share_exactly_the_common_full_chunks():
    index = PrefixIndex(2, chunk_chars=64)
    short, longer = render_chat(_chat(1)), render_chat(_chat(3))
    assert longer.startswith(short)
    a, b = index.keys(short), index.keys(longer)
    assert len(a) == len(short) // 64 and a == b[:len(a)]  # only full chunks, chained identically
    # one changed character early on changes every later key (the chain), not only its own chunk
    edited = "X" + longer[1:]
    c = index.keys(edited)
    assert all(x != y for x, y in zip(b, c, strict=True))
    # bounded work per request: at most max_chunks keys, however long the text
    assert len(PrefixIndex(1, chunk_chars=16, max_chunks=10).keys("z" * 10_000)) == 10
    assert render_prompt(["p1", "p2"]) == "p1" and render_prompt(7) == "" and render_chat("nope") == ""


def test_matched_counts_the_leading_chunks_each_replica_was_sent():
    index = PrefixIndex(3, chunk_chars=32)
    turn1, turn3 = index.keys(render_chat(_chat(1))), index.keys(render_chat(_chat(3)))
    assert index.matched(turn3) == [0, 0, 0]
    index.record(turn1, 1)
    assert index.matched(turn3) == [0, len(turn1), 0]
    index.record(turn3, 2)
    assert index.matched(turn3) == [0, len(turn1), len(turn3)]
    # a replica holding later chunks but not the first one holds no usable prefix
    index.record(turn3[1:], 0)
    assert index.matched(turn3)[0] == 0
    index.check_integrity()


def test_forgetting_a_replica_drops_only_its_claims_until_it_is_sent_the_prefix_again():
    index = PrefixIndex(2, chunk_chars=32)
    keys = index.keys(render_chat(_chat(2)))
    index.record(keys, 0)
    index.record(keys, 1)
    index.forget(0)
    assert index.matched(keys) == [0, len(keys)]
    index.record(keys[:3], 0)
    assert index.matched(keys) == [3, len(keys)]
    index.forget(1)
    assert index.matched(keys) == [3, 0]


def test_index_is_bounded_and_evicts_the_least_recently_sent():
    index = PrefixIndex(2, chunk_chars=8, max_entries=50)
    old = index.keys("a" * 8 * 20)
    index.record(old, 0)
    for i in range(10):
        index.record(index.keys(f"{i:08d}" * 10), 1)
    assert len(index) == 50 and index.evictions == 20 + 10 * 10 - 50
    assert index.matched(old)[0] == 0  # its head was evicted first
    index.check_integrity()


def test_prefix_routing_trades_matched_share_against_load():
    loads = [ReplicaLoad(0, in_flight=4), ReplicaLoad(1, in_flight=0)]
    index = PrefixIndex(2, chunk_chars=32)
    keys = index.keys(render_chat(_chat(2)))
    index.record(keys, 0)
    # share 1.0 - 0.5 x 1.0 = 0.5 beats 0.0 - 0: the busier replica holding the prefix wins
    d = PrefixAware(2, beta=0.5, index=index).choose(RouteRequest(keys), loads)
    assert (d.replica, d.reason, d.share) == (0, "prefix_hit", 1.0)
    # beta 2: 1.0 - 2.0 = -1.0 loses to the idle one
    index2 = PrefixIndex(2, chunk_chars=32)
    index2.record(keys, 0)
    d = PrefixAware(2, beta=2.0, index=index2).choose(RouteRequest(keys), loads)
    assert (d.replica, d.reason) == (1, "load")
    # an overloaded replica (more than `imbalance` above the least loaded) gets no prefix traffic
    index3 = PrefixIndex(2, chunk_chars=32)
    index3.record(keys, 0)
    busy = [ReplicaLoad(0, in_flight=5, queued=6), ReplicaLoad(1, in_flight=1)]
    d = PrefixAware(2, beta=0.0, imbalance=8, index=index3).choose(RouteRequest(keys), busy)
    assert (d.replica, d.reason) == (1, "load")
    # after routing, the index says replica 1 holds the prefix too
    assert index3.matched(keys) == [len(keys), len(keys)]


def test_new_prefixes_go_to_the_least_loaded_and_spread_over_equals():
    router = PrefixAware(3, beta=0.5)
    loads = [ReplicaLoad(0, 2), ReplicaLoad(1, 0), ReplicaLoad(2, 0, queued=1)]
    chosen = {router.choose(RouteRequest(router.index.keys(f"{i} " * 200)), loads).replica for i in range(6)}
    assert chosen == {1}
    even = [ReplicaLoad(0), ReplicaLoad(1), ReplicaLoad(2)]
    picks = [router.choose(RouteRequest(router.index.keys(f"doc {i} " * 100)), even) for i in range(6)]
    assert {p.replica for p in picks} == {0, 1, 2} and {p.reason for p in picks} == {"load"}


def test_sessions_stick_unless_their_replica_is_overloaded_or_gone():
    router = PrefixAware(2, beta=0.5, imbalance=3)
    first = router.choose(RouteRequest([], session="alice"), [ReplicaLoad(0, 1), ReplicaLoad(1, 0)])
    assert first.replica == 1
    again = router.choose(RouteRequest([], session="alice"), [ReplicaLoad(0, 0), ReplicaLoad(1, 3)])
    assert (again.replica, again.reason) == (1, "sticky")  # 3 above the least loaded: not over 3
    moved = router.choose(RouteRequest([], session="alice"), [ReplicaLoad(0, 0), ReplicaLoad(1, 4)])
    assert (moved.replica, moved.reason) == (0, "load")
    back = router.choose(RouteRequest([], session="alice"), [ReplicaLoad(0, 5), ReplicaLoad(1, 5)])
    assert (back.replica, back.reason) == (0, "sticky")  # it lives on replica 0 now
    gone = router.choose(RouteRequest([], session="alice"), [ReplicaLoad(1, 9)])
    assert gone.replica == 1
    small = PrefixAware(2, max_sessions=2)
    for name in ("a", "b", "c"):
        small.choose(RouteRequest([], session=name), [ReplicaLoad(0), ReplicaLoad(1)])
    assert small.choose(RouteRequest([], session="a"), [ReplicaLoad(0), ReplicaLoad(1)]).reason == "load"


def test_round_robin_and_least_loaded():
    rr = RoundRobin()
    every = [ReplicaLoad(i) for i in range(3)]
    assert [rr.choose(RouteRequest(), every).replica for _ in range(4)] == [0, 1, 2, 0]
    # replica 2 out: the others keep their turns
    assert [rr.choose(RouteRequest(), every[:2]).replica for _ in range(3)] == [1, 0, 1]
    ll = LeastLoaded()
    assert ll.choose(RouteRequest(), [ReplicaLoad(0, 3), ReplicaLoad(1, 1, queued=3), ReplicaLoad(2, 2)]).replica == 2
    ties = {ll.choose(RouteRequest(), [ReplicaLoad(0, 1), ReplicaLoad(1, 1)]).replica for _ in range(4)}
    assert ties == {0, 1}
    with pytest.raises(ValueError):
        make_router("random", 2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4,
                unique_by=lambda t: t[0]),
       st.lists(st.sampled_from(["aaaa", "bbbb", "abab"]), min_size=0, max_size=12),
       st.sampled_from([None, "s1", "s2"]), st.floats(0, 4))
def test_any_policy_returns_a_candidate_and_the_index_stays_bounded(loads, parts, session, beta):
    candidates = [ReplicaLoad(i, f, q) for i, f, q in loads]
    router = PrefixAware(4, beta=beta, imbalance=4, index=PrefixIndex(4, chunk_chars=4, max_entries=16))
    for _ in range(3):
        req = RouteRequest(router.index.keys("".join(parts)), session)
        d = router.choose(req, candidates)
        assert d.replica in {c.index for c in candidates} and 0.0 <= d.share <= 1.0
        least = min(c.load for c in candidates)
        assert next(c for c in candidates if c.index == d.replica).load - least <= 4
    router.index.check_integrity()
    for r in (RoundRobin(), LeastLoaded()):
        assert r.choose(RouteRequest(), candidates).replica in {c.index for c in candidates}


def test_queue_depth_reads_vllm_tierguard_and_schedule_gauges():
    text = (b'# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="m"} 3.0\n'
            b'vllm:num_requests_running{model_name="m"} 7.0\n'
            b'tierguard_gate_queue_depth{class="interactive"} 2.0\ntierguard_gate_queue_depth{class="long"} 1.0\n'
            b"schedule_requests_waiting 4\nvllm:num_requests_waiting_total 99\n")
    assert queue_depth(text) == 10
    assert queue_depth(b"garbage") == 0


def test_the_policy_modules_import_no_http():
    import subprocess
    import sys

    code = ("import sys; import tierguard.gate.routing, tierguard.gate.prefix_index; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'redis', 'http')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
