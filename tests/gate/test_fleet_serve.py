"""The gate over two real `tierguard serve --model tiny` replicas (slow: two engines start)."""

from __future__ import annotations

import sys

import aiohttp
import pytest

from tests.gate.helpers import GateProcess, metric, run
from tierguard.common.proc import ReadyProcess

pytestmark = pytest.mark.slow


def _serve(tmp_path, i: int) -> ReadyProcess:
    child = ReadyProcess([sys.executable, "-m", "tierguard.cli.main", "serve", "--model", "tiny", "--port", "0"],
                         "tierguard serve: ready on ", stderr_path=tmp_path / f"serve{i}.err", grace_s=10.0)
    child.url = child.start(300).split()[0]  # type: ignore[attr-defined]
    return child


def test_prefix_routing_hits_the_replica_cache_and_survives_a_killed_replica(tmp_path):
    replicas = [_serve(tmp_path, i) for i in range(2)]
    try:
        urls = [r.url for r in replicas]  # type: ignore[attr-defined]
        with GateProcess(urls[0], "--upstream", urls[1], "--route", "prefix", "--health-interval-s", "30",
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
