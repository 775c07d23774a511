"""The remote tier on a real Redis Cluster behind real engines (the tiny model).

Default: a prefix one engine wrote is loaded by another through the cluster, with the
same greedy tokens and every Redis round trip off the engine thread; a master frozen with
SIGSTOP costs only the blocks in its slots while requests keep their staging deadlines.
Slow: two gates sharing one limit over two serve replicas, flooded while the master that
holds the gates' leases (and a third of the blocks) is killed with SIGKILL."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.conftest import make_engine
from tests.engine.guard_spy import GuardSpy
from tests.engine.test_tiers import PROMPTS, run
from tests.kv.conftest import wait_until
from tierguard.engine.api import SamplingParams
from tierguard.engine.prefix_hash import prefix_block_hashes

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return run(make_engine(tiny_dir), PROMPTS, SHORT)


def remote(url: str, **kw) -> dict:
    return {"remote": {"url": url, "refresh_s": 0.02, "timeout_ms": 50, "namespace": kw.pop("namespace"), **kw}}


def flat(engine) -> dict[str, float]:
    return engine.stats().flat()


def spy_on(engine) -> GuardSpy:
    """Every Redis round trip of the remote medium (a node's pipeline, a cluster command)
    must stay off the engine thread."""
    medium = engine.connector.media["remote"]
    return GuardSpy(engine, off_engine=(("remote.node_pipeline", medium.nodes, "run"),
                                        ("remote.cluster_command", medium.client, "execute_command")))


def test_a_prefix_written_by_one_engine_is_loaded_by_another_through_the_cluster(
        tiny_dir, reference, redis_cluster, request):
    media = remote(redis_cluster.url, namespace=request.node.name[-24:])
    a = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=media)
    b = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=media)
    try:
        assert run(a, PROMPTS[:3], SHORT) == reference[:3]
        a.close()  # the write-behind ends here
        written = flat(a)["kv_remote_writes"]
        medium = b.connector.media["remote"]
        wait_until(lambda: len(medium.index) == written)  # from the journal, on one shard
        keys = [medium.key(h) for p in PROMPTS[:3] for h in prefix_block_hashes(p, 4, b.block_manager.fingerprint)
                if medium.contains(h)]
        assert len(set(redis_cluster.masters_of(keys))) == 3  # the prefixes live on every shard
        spy = spy_on(b)
        assert run(b, PROMPTS[:3], SHORT) == reference[:3]
        spy.assert_contract(read_media=("remote",))
        x = flat(b)
        assert x["kv_remote_hits"] > 0 and x["kv_blocks_loaded_from_remote"] == x["kv_remote_hits"]
        assert x["kv_remote_misses"] == 0 and x["kv_remote_errors"] == 0
    finally:
        b.close()


def test_a_frozen_shard_costs_only_its_blocks_and_requests_keep_their_deadlines(
        tiny_dir, reference, redis_cluster, request):
    """One master stopped (SIGSTOP) with its reads slower than the staging deadline: the
    first interactive loads that wait on it are abandoned at their deadline and recomputed
    (counted); once its breaker is open its blocks are refused at once, and the blocks of
    the other shards are still loaded: prefixes whose first blocks live elsewhere hit. The
    same greedy tokens throughout, the contract held."""
    namespace = request.node.name[-24:]
    writer = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=remote(redis_cluster.url, namespace=namespace))
    run(writer, PROMPTS, SHORT)
    writer.close()
    media = remote(redis_cluster.url, namespace=namespace, refresh_s=60, timeout_ms=400)
    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_media=media, ttft_budget_ms={"interactive": 100})
    medium = engine.connector.media["remote"]
    fp = engine.block_manager.fingerprint

    hashes = sorted({h for p in PROMPTS for h in prefix_block_hashes(p, 4, fp)})
    master = dict(zip(hashes, redis_cluster.masters_of([medium.key(h) for h in hashes]), strict=True))
    firsts = [master[prefix_block_hashes(p, 4, fp)[0]] for p in PROMPTS[3:]]
    # freeze a master that holds neither the journal nor the first block of the last prompts
    candidates = [m for m in redis_cluster.masters() if m != redis_cluster.master_of(medium.index.journal_key)]
    hung = max(candidates, key=lambda m: sum(f != m for f in firsts))
    assert any(f != hung for f in firsts)
    on_hung = {h for h in hashes if master[h] == hung}
    loaded: list[int] = []
    read_many = medium.read_many

    def recording(items):
        ok = read_many(items)
        loaded.extend(h for (h, _), good in zip(items, ok, strict=True) if good)
        return ok

    medium.read_many = recording
    spy = spy_on(engine)
    redis_cluster.pause(hung)
    try:
        got = []
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SHORT, request_class="interactive")
            out: list[int] = []
            while engine.has_unfinished():
                for o in engine.step():
                    out.extend(o.new_token_ids)
            got.append(out)
        assert got == reference
        x = flat(engine)
        assert x["kv_staging_deadline_misses_interactive"] >= 1  # it did not wait for the frozen shard
        assert x["kv_contract_interactive_recompute"] >= x["kv_staging_deadline_misses_interactive"]
        assert loaded and not set(loaded) & on_hung  # blocks arrived, none of them from the frozen shard
        assert x["kv_remote_hits"] > 0  # and the engine used them
        assert not medium.healthy and f":{hung} (open)" in medium.reason and medium.reason.count("(open)") == 1
        spy.assert_contract(read_media=("remote",))
    finally:
        redis_cluster.resume(hung)
        engine.close()


# ---- slow: the lease master killed in a flood ------------------------------------------------

LIMIT, GATES = 4, 2
BOUND = LIMIT + (GATES - 1) * (LIMIT // GATES)  # docs/fleet.md: at most N-1 local shares above the limit


def _doc(loop: int, j: int) -> str:
    return f"manual {loop}-{j}: " + "the pump has a valve, a seal and a gauge. " * 5


async def _flood(s, gates, loop: int, stop, answers: list) -> None:
    """Each document goes through both gates in turn (so each serve replica loads prefixes the
    other one wrote); every answer is kept: (doc, gate, status, text)."""
    j = 0
    while not stop.is_set():
        doc = _doc(loop, j)
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "which part?"}]}
        for g in (gates if j % 2 == 0 else gates[::-1]):
            try:
                async with s.post(g.url + "/v1/chat/completions", json=body) as r:
                    data = await r.json(content_type=None)
                    text = data["choices"][0]["message"]["content"] if r.status == 200 else str(data)
                    answers.append((doc, g.url, r.status, text))
            except Exception as exc:  # noqa: BLE001 - any failure is a failed request, counted
                answers.append((doc, g.url, "error", repr(exc)))
                await asyncio.sleep(0.05)
        j += 1


@pytest.mark.slow
def test_a_master_killed_mid_flood_fails_nothing_and_keeps_the_failover_bound(tmp_path, failover_cluster):
    """Two gates share --max-concurrency 4 on the cluster, each in front of its own serve
    replica; both replicas share the remote tier on the same cluster. Flooded at 3x the
    limit, the master holding the gates' lease slot (and a third of the blocks) is killed
    with SIGKILL. No request fails; each document gets the same greedy answer from both
    replicas throughout; the blocks of the lost shard are recomputed and counted, and
    blocks are read from the promoted replica once the cluster has failed over; the
    servers' own running counts never pass the documented bound, and never the limit
    before the kill; every lease is back in Redis, and none is left once the flood ends."""
    import json
    import time

    import aiohttp

    from tests.gate.helpers import GateProcess, get_json, metric
    from tests.serve.helpers import serve
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.serve.app import create_app

    cluster = failover_cluster
    media = {"remote": {"url": cluster.url, "timeout_ms": 50, "refresh_s": 0.05}}
    engines = [AsyncLLMEngine.from_model_dir(ensure_tiny_model(), model_name="tiny", max_model_len=512,
                                             kv_cache_gib=0.004, kv_host_gib=0.002, kv_media=media, block_size=4,
                                             dtype="float32", device="cpu", num_threads=1) for _ in range(2)]
    tiers = [e.engine.connector.media["remote"] for e in engines]
    lease_key = "{tierguard:gate}:slots"
    killed = cluster.master_of(lease_key)
    reads: list[tuple[float, str, int]] = []  # (time, node, blocks returned): the tiers' round trips

    def recording(run):
        def spy(node, commands):
            replies = run(node, commands)
            reads.append((time.monotonic(), node, sum(isinstance(r, bytes) for r in replies)))
            return replies
        return spy

    for t in tiers:
        t.nodes.run = recording(t.nodes.run)

    async def main():
        async with serve(create_app(engines[0])) as r0, serve(create_app(engines[1])) as r1:
            flags = ("--max-concurrency", str(LIMIT), "--max-queue-wait-ms", "60000", "--shared-state", cluster.url,
                     "--lease-ms", "1500", "--shared-timeout-ms", "100", "--health-interval-s", "5")
            urls = [str(r.make_url("")).rstrip("/") for r in (r0, r1)]
            ga, gb = (GateProcess(u, *flags, jobs_dir=tmp_path / n) for u, n in zip(urls, "ab", strict=True))
            try:  # started off the loop: the replicas on this loop answer the gates' probes meanwhile
                await asyncio.gather(asyncio.to_thread(ga.start), asyncio.to_thread(gb.start))
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                    for g in (ga, gb):
                        while not (await get_json(s, g.url + "/health"))[1]["shared_state"]["up"]:
                            await asyncio.sleep(0.05)
                    stop, answers, samples = asyncio.Event(), [], []

                    async def sample():
                        while not stop.is_set():
                            samples.append((time.monotonic(), sum(e.stats().num_running + e.stats().num_waiting
                                                                  for e in engines)))
                            await asyncio.sleep(0.005)

                    watch = asyncio.create_task(sample())
                    flood = [asyncio.create_task(_flood(s, (ga, gb), i, stop, answers)) for i in range(3 * LIMIT)]
                    deadline = time.monotonic() + 120
                    while not all(e.stats().flat().get("kv_remote_hits", 0) > 0 for e in engines):
                        assert time.monotonic() < deadline, "no remote-tier hits before the kill"
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(1.0)
                    t_kill = time.monotonic()
                    cluster.kill(killed)  # SIGKILL: the gates' lease slot and a third of the blocks
                    promoted = await asyncio.to_thread(cluster.wait_for_failover, killed, 60)
                    t_failover = time.monotonic()
                    while not all([(await get_json(s, g.url + "/health"))[1]["shared_state"]["up"] for g in (ga, gb)]):
                        assert time.monotonic() < t_kill + 60, "the gates never returned to shared limits"
                        await asyncio.sleep(0.05)
                    t_shared = time.monotonic()
                    while not any(n.endswith(f":{promoted}") and k for t, n, k in reads if t > t_kill):
                        assert time.monotonic() < t_kill + 60, "no block read from the promoted replica"
                        await asyncio.sleep(0.05)
                    t_hits = min(t for t, n, k in reads if t > t_kill and n.endswith(f":{promoted}") and k)
                    await asyncio.sleep(max(0.0, t_shared + 4.0 - time.monotonic()))
                    stop.set()
                    await asyncio.gather(*flood, watch)
                    readded = [await metric(s, g.url, "tierguard_gate_shared_leases_readded_total") for g in (ga, gb)]
                    left = None
                    for _ in range(200):  # every lease released (or expired): none leaked
                        left = cluster.client(promoted).zcard(lease_key)
                        if left == 0:
                            break
                        await asyncio.sleep(0.05)
            finally:
                for g in (ga, gb):
                    await asyncio.to_thread(g.stop)
        return t_kill, t_failover, t_shared, t_hits, answers, samples, readded, left

    try:
        t_kill, t_failover, t_shared, t_hits, answers, samples, readded, left = asyncio.run(main())
    finally:
        for e in engines:
            e.engine.close()
    x = [e.stats().flat() for e in engines]
    failed = [a for a in answers if a[2] != 200]
    assert not failed, failed[:5]
    by_doc: dict[str, set[str]] = {}
    for doc, _, _, text in answers:
        by_doc.setdefault(doc, set()).add(text)
    assert all(len(texts) == 1 for texts in by_doc.values())  # greedy: the same answer from both replicas
    before = max(n for t, n in samples if t < t_kill)
    during = max(n for t, n in samples)
    assert before <= LIMIT and during <= BOUND, (before, during)
    assert max(n for t, n in samples if t > t_shared + 1.5) <= LIMIT  # exact again once every gate settled
    lost = sum(v.get("kv_remote_errors", 0) + v.get("kv_remote_unavailable", 0) for v in x)
    recomputed = sum(v.get(k, 0) for v in x for k in v if k.startswith("kv_contract_") and k.endswith("_recompute"))
    assert lost > 0 and recomputed > 0  # the lost shard's blocks: counted, recomputed
    assert sum(readded) > 0 and left == 0  # leases written back to the new master; none leaked
    print(json.dumps({"requests": len(answers), "failed": len(failed), "limit": LIMIT, "bound": BOUND,
                      "max_running_before_kill": before, "max_running": during,
                      "failover_s": round(t_failover - t_kill, 2), "shared_limits_back_s": round(t_shared - t_kill, 2),
                      "remote_hits_back_s": round(t_hits - t_kill, 2), "lost_block_reads": lost,
                      "recomputes": recomputed, "leases_written_back": sum(readded)}))
