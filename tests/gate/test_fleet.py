"""A gate in front of several real upstream processes: failover, ejection, routing."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.gate.helpers import GateProcess, get_json, metric, run, schedule_server_on, stream_request
from tierguard.bench.schedule_server import ScheduleServer


def _chat(system: str, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"turn {t}: " + "tell me more about the reactor. " * 10})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": " tok" * 8})
    return msgs


def test_failover_ejection_and_readmission(tmp_path):
    """A replica killed with SIGKILL: its running stream ends with an error event (never a second
    answer), the next request meant for it is retried on the other replica before any byte went
    out, it is ejected, and it takes traffic again once it is back and passes a probe."""
    sched = dict(ttft_ms=20, itl_ms=10)
    log = tmp_path / "req.jsonl"
    with ScheduleServer(**sched) as up0, ScheduleServer(**sched) as up1, \
            GateProcess(up0.base_url, "--upstream", up1.base_url, "--route-headers", "--route", "round-robin",
                        "--health-interval-s", "30", jobs_dir=tmp_path / "jobs", log=log) as gate:
        url = gate.url + "/v1/completions"
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}

        async def main():
            async with aiohttp.ClientSession() as s:
                picks = [(await stream_request(s, url, body))["headers"]["X-Tierguard-Replica"] for _ in range(5)]
                assert picks == ["0", "1", "0", "1", "0"]
                # a long stream on replica 1, then replica 1 dies mid-stream
                events = []
                async with s.post(url, json={**body, "max_tokens": 300, "stream": True}) as r:
                    assert r.headers["X-Tierguard-Replica"] == "1"
                    first = await r.content.readany()
                    up1.proc.kill()
                    rest = await r.read()
                events = [e for e in (first + rest).decode().split("\n\n") if e.strip()]
                payloads = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
                assert "data: [DONE]" not in events
                assert payloads[-1]["error"]["type"] == "upstream_error"  # one error event ends it
                ids = {p["id"] for p in payloads[:-1]}
                assert len(ids) == 1 and len(payloads) - 1 < 300  # one answer, cut short, never restarted
                # the next turn was replica 1's: refused there, answered by replica 0, before any byte
                results = [await stream_request(s, url, body) for _ in range(4)]
                assert [r["status"] for r in results] == [200] * 4
                assert {r["headers"]["X-Tierguard-Replica"] for r in results} == {"0"}
                assert "failover" in {r["headers"]["X-Tierguard-Route"] for r in results}
                assert await metric(s, gate.url, "tierguard_gate_routed_total", reason="failover") == 1
                assert await metric(s, gate.url, "tierguard_gate_upstream_healthy", upstream=up1.base_url) == 0
                assert await metric(s, gate.url, "tierguard_gate_upstream_ejections_total",
                                    upstream=up1.base_url) == 1
                status, health = await get_json(s, gate.url + "/health")
                assert status == 200 and health["status"] == "degraded"
                assert [u["healthy"] for u in health["upstreams"]] == [True, False]
                # back on the same port: readmitted by a probe after its backoff (1 s), traffic resumes
                again = schedule_server_on(up1.port, **sched)
                try:
                    for _ in range(60):
                        if await metric(s, gate.url, "tierguard_gate_upstream_healthy", upstream=up1.base_url):
                            break
                        await asyncio.sleep(0.1)
                    results = [await stream_request(s, url, body) for _ in range(4)]
                    assert {r["headers"]["X-Tierguard-Replica"] for r in results} == {"0", "1"}
                finally:
                    again.stop()

        run(main())
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["routed"] for r in records].count("failover") == 1
    assert all(r["upstream"] in (0, 1) for r in records)


def _turns(gate_url: str, chats: int, turns: int) -> dict:
    """Chats played turn by turn, interleaved; returns {chat: [(replica, route reason) per turn]}."""

    async def main():
        out: dict[int, list] = {c: [] for c in range(chats)}
        async with aiohttp.ClientSession() as s:
            for t in range(1, turns + 1):
                for c in range(chats):
                    body = {"model": "m", "messages": _chat(f"chat {c}: you are a careful engineer. " * 12, t),
                            "max_tokens": 4}
                    r = await stream_request(s, gate_url + "/v1/chat/completions", body)
                    assert r["status"] == 200
                    out[c].append((r["headers"]["X-Tierguard-Replica"], r["headers"]["X-Tierguard-Route"]))
        return out

    return run(main())


def test_prefix_routing_keeps_each_chat_where_its_prefix_is_and_sessions_stick(tmp_path):
    with ScheduleServer(ttft_ms=5, itl_ms=1) as up0, ScheduleServer(ttft_ms=5, itl_ms=1) as up1:
        with GateProcess(up0.base_url, "--upstream", up1.base_url, "--route-headers", "--route", "prefix",
                         jobs_dir=tmp_path / "jobs") as gate:
            placed = _turns(gate.url, chats=5, turns=3)

            async def sessions():
                async with aiohttp.ClientSession() as s:
                    homes = []
                    for i in range(4):  # unrelated prompts, one user: one replica
                        body = {"model": "m", "prompt": f"unrelated {i} " * 3, "user": "alice", "max_tokens": 2}
                        r = await stream_request(s, gate.url + "/v1/completions", body)
                        homes.append((r["headers"]["X-Tierguard-Replica"], r["headers"]["X-Tierguard-Route"]))
                    assert len({h[0] for h in homes}) == 1 and [h[1] for h in homes[1:]] == ["sticky"] * 3
                    assert await metric(s, gate.url, "tierguard_gate_routed_total", reason="prefix_hit") == 10
                    assert await metric(s, gate.url, "tierguard_gate_prefix_index_entries") > 0

            run(sessions())
        with GateProcess(up0.base_url, "--upstream", up1.base_url, "--route-headers", "--route", "round-robin",
                         jobs_dir=tmp_path / "jobs2") as gate:
            spread = _turns(gate.url, chats=5, turns=3)
    for turns in placed.values():
        assert len({replica for replica, _ in turns}) == 1, placed  # every turn where the chat began
        assert [reason for _, reason in turns[1:]] == ["prefix_hit", "prefix_hit"], placed
    assert {turns[0][0] for turns in placed.values()} == {"0", "1"}  # new chats spread over both
    assert any(len({replica for replica, _ in turns}) > 1 for turns in spread.values())  # the baseline moves them
