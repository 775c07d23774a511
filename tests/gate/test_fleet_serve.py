"""The gate over two real `tierguard serve --model tiny` replicas: the slow test starts two
server processes and kills one; its small version runs the two replicas' apps in this
process (each on its own real engine) behind a real gate process."""

from __future__ import annotations

import sys

import aiohttp
import pytest

from tests.gate.helpers import GateProcess, metric, run
from tierguard.common.proc import ReadyProcess


def test_prefix_routing_sends_each_chats_turns_to_the_replica_that_cached_its_prefix(tmp_path):
    """Two chats, three turns each, through `--route prefix` over two real engines: each
    chat stays on one replica (the two on different ones), and from its second turn on
    that replica answers from its prefix cache (cached tokens in its usage)."""
    import asyncio

    from tests.serve.helpers import serve
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.serve.app import create_app

    engines = [AsyncLLMEngine.from_model_dir(ensure_tiny_model(), model_name="tiny", max_model_len=1024,
                                             kv_cache_gib=0.02, dtype="float32", device="cpu") for _ in range(2)]

    async def main():
        async with serve(create_app(engines[0], prompt_tokens_details=True)) as r0, \
                serve(create_app(engines[1], prompt_tokens_details=True)) as r1:
            urls = [str(r.make_url("")).rstrip("/") for r in (r0, r1)]
            with GateProcess(urls[0], "--upstream", urls[1], "--route-headers", "--route", "prefix", "--health-interval-s", "30",
                             jobs_dir=tmp_path / "jobs") as gate:
                async with aiohttp.ClientSession() as s:
                    seen: dict[int, list] = {0: [], 1: []}
                    chats = {c: [{"role": "system", "content": f"manual {c}: " + "the pump has a valve. " * 30}]
                             for c in range(2)}
                    for turn in range(3):
                        for c, msgs in chats.items():
                            msgs.append({"role": "user", "content": f"question {turn}: " + "why? " * 20})
                            body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0}
                            async with s.post(gate.url + "/v1/chat/completions", json=body) as r:
                                data = await r.json()
                                assert r.status == 200, data
                                cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                                seen[c].append((r.headers["X-Tierguard-Replica"], r.headers["X-Tierguard-Route"],
                                                cached))
                            msgs.append({"role": "assistant", "content": "check the valve"})
                    return seen

    seen = asyncio.run(main())
    for turns in seen.values():
        assert len({t[0] for t in turns}) == 1, seen  # the chat stayed on one replica
        assert all(route == "prefix_hit" and cached > 0 for _, route, cached in turns[1:]), seen
    assert {seen[0][0][0], seen[1][0][0]} == {"0", "1"}, seen  # the two chats on different replicas


def _serve(tmp_path, i: int) -> ReadyProcess:
    child = ReadyProcess([sys.executable, "-m", "tierguard.cli.main", "serve", "--model", "tiny", "--port", "0",
                          "--enable-prompt-tokens-details"],
                         "tierguard serve: ready on ", stderr_path=tmp_path / f"serve{i}.err", grace_s=10.0)
    child.url = child.start(300).split()[0]  # type: ignore[attr-defined]
    return child


@pytest.mark.slow
def test_prefix_routing_hits_the_replica_cache_and_survives_a_killed_replica(tmp_path):
    replicas = [_serve(tmp_path, i) for i in range(2)]
    try:
        urls = [r.url for r in replicas]  # type: ignore[attr-defined]
        with GateProcess(urls[0], "--upstream", urls[1], "--route-headers", "--route", "prefix", "--health-interval-s", "30",
                         jobs_dir=tmp_path / "jobs") as gate:

            async def main():
                async with aiohttp.ClientSession() as s:
                    chats = {c: [{"role": "system", "content": f"manual {c}: " + "the pump has a valve. " * 40}]
                             for c in range(2)}
                    seen: dict[int, list] = {0: [], 1: []}
                    for turn in range(3):
                        for c, msgs in chats.items():
                            msgs.append({"role": "user", "content": f"question {turn}: " + "why? " * 30})
                            body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0}
                            async with s.post(gate.url + "/v1/chat/completions", json=body) as r:
                                data = await r.json()
                                assert r.status == 200, data
                                cached = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                                seen[c].append((r.headers["X-Tierguard-Replica"], r.headers["X-Tierguard-Route"],
                                                cached))
                            msgs.append({"role": "assistant", "content": "check the valve"})
                    for turns in seen.values():
                        assert len({t[0] for t in turns}) == 1, seen  # the chat stayed on one replica
                        assert all(route == "prefix_hit" and cached > 0 for _, route, cached in turns[1:]), seen
                    assert {seen[0][0][0], seen[1][0][0]} == {"0", "1"}  # the two chats on different replicas
                    # the replica of chat 0 dies: its next turn is answered by the other one
                    victim = int(seen[0][0][0])
                    replicas[victim].kill()
                    chats[0].append({"role": "user", "content": "and now?"})
                    body = {"model": "tiny", "messages": chats[0], "max_tokens": 4, "temperature": 0}
                    async with s.post(gate.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        assert r.headers["X-Tierguard-Replica"] == str(1 - victim)
                        assert r.headers["X-Tierguard-Route"] == "failover"
                    assert await metric(s, gate.url, "tierguard_gate_upstream_healthy", upstream=urls[victim]) == 0

            run(main())
    finally:
        for r in replicas:
            r.stop()
