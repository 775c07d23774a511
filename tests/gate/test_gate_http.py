"""The gate as a real process in front of a real schedule server: HTTP behaviour."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp

from tests.gate.helpers import GateProcess, get_json, run, stream_request
from tierguard.bench.schedule_server import ScheduleServer

KEY = "sk-test-7f3a9c"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": "secretprompt " + "w " * 20})
    return msgs


def test_proxy_behaviour(tmp_path):
    log = tmp_path / "req.jsonl"
    with ScheduleServer(capacity=4, ttft_ms=30, itl_ms=60, output_tokens=20) as up, \
            GateProcess(up.base_url, "--api-key", KEY, "--max-body-bytes", "4KiB", "--max-concurrency", "1",
                        "--max-input-tokens", "200", "--max-queue-wait-ms", "3000",
                        jobs_dir=tmp_path / "jobs", log=log) as gate:

        async def main():
            async with aiohttp.ClientSession() as s:
                url = gate.url + "/v1/chat/completions"
                body = {"model": "m", "messages": _chat(1), "stream": True, "max_tokens": 20}
                # auth: constant-time check, 401 without the key
                r = await stream_request(s, url, body)
                assert r["status"] == 401 and r["body"]["error"]["type"] == "authentication_error"
                # streaming passthrough: the same events as the upstream sends
                direct, via = [], []
                async with s.post(up.base_url + "/v1/chat/completions", json=body) as d:
                    direct = (await d.read()).split(b"\n\n")
                async with s.post(url, json=body, headers=AUTH) as g:
                    assert g.headers["X-Tierguard-Class"] == "interactive"
                    via = (await g.read()).split(b"\n\n")
                assert len(via) == len(direct) == 22 and via[-2] == b"data: [DONE]"
                assert [json.loads(e[6:])["choices"] for e in via[:-2]] == \
                       [json.loads(e[6:])["choices"] for e in direct[:-2]]
                # malformed JSON, oversize body
                async with s.post(url, data=b"{nope", headers=AUTH) as r:
                    assert r.status == 400 and "malformed" in (await r.json())["error"]["message"]
                async with s.post(url, data=b'{"x":"' + b"a" * 8000 + b'"}', headers=AUTH) as r:
                    assert r.status == 413
                # context downgrade: oldest turns dropped to fit --max-input-tokens, header set
                long_body = {"model": "m", "messages": _chat(15), "max_tokens": 2}
                r = await stream_request(s, url, long_body, AUTH)
                assert r["status"] == 200 and "X-Tierguard-Downgraded" in r["headers"]
                before, after = map(int, r["headers"]["X-Tierguard-Downgraded"].split("->"))
                assert after <= 200 < before
                # client disconnect frees the only slot and cancels the upstream stream
                async with s.post(url, json=body, headers=AUTH) as g:
                    await g.content.readany()
                    assert (await get_json(s, up.base_url + "/health"))[1]["active"] == 1
                r = await stream_request(s, url, body, AUTH)
                assert r["status"] == 200
                # The upstream's own record (same clock for both rows): the gone stream was cut
                # short, and the next request reached the upstream before the gone one would have
                # ended (30 + 19 x 60 ms after its start): it did not queue behind a gone client.
                truth = (await get_json(s, up.base_url + "/truth"))[1]["requests"]
                gone, nxt = truth[-2], truth[-1]
                assert len(gone["times"]) < 20, gone
                assert nxt["arrival"] < gone["start"] + (30 + 19 * 60) / 1000
                await asyncio.sleep(0.2)
                assert (await get_json(s, up.base_url + "/health"))[1]["active"] == 0
                # metrics show decisions with reasons
                async with s.get(gate.url + "/metrics") as m:
                    text = await m.text()
                assert 'tierguard_gate_decisions_total{decision="downgrade",reason="input_over_max"} 1.0' in text
                assert "tierguard_gate_ttft_seconds_bucket" in text

        run(main())
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    raw = log.read_text()
    assert KEY not in raw and "secretprompt" not in raw
    assert {x["status"] for x in lines} >= {200, 400, 401, 413}
    down = [x for x in lines if x["decision"] == "downgrade"]
    assert down and down[0]["downgraded_from"] > down[0]["input_tokens"]
    assert any(x["status"] == 499 for x in lines)
    ok = [x for x in lines if x["status"] == 200 and x["stream"]]
    assert all(x["ttft_ms"] > 0 and x["e2e_ms"] >= x["ttft_ms"] and x["output_tokens"] for x in ok)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_upstream_down_answers_fast(tmp_path):
    """A refused upstream connection is answered at once, not after the connect timeout:
    the timeout is set far beyond the test's hang guards (a gate that waited it out fails
    them), and the gate's own record of the request shows no wait near it. The stalled
    body is cut by --body-timeout-s, never before it (the gate's record again)."""
    connect_timeout_s = 120
    log = tmp_path / "req.jsonl"
    with GateProcess(f"http://127.0.0.1:{_dead_port()}", "--body-timeout-s", "0.3", "--max-concurrency", "1",
                     "--connect-timeout-s", str(connect_timeout_s), jobs_dir=tmp_path / "jobs", log=log) as gate:
        async def main():
            guard = aiohttp.ClientTimeout(total=30)  # a hang guard, a quarter of the connect timeout
            async with aiohttp.ClientSession(timeout=guard) as s:
                r = await stream_request(s, gate.url + "/v1/completions", {"prompt": "hi", "stream": True})
                assert r["status"] == 502 and "unreachable" in r["body"]["error"]["message"]
                status, health = await get_json(s, gate.url + "/health")
                assert status == 503 and health["status"] == "upstream_down"
                # a client that sends headers and then stalls gets 408 and never held the slot
                reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"prompt\":")
                await writer.drain()
                status, health = await get_json(s, gate.url + "/health")
                assert health["in_flight"]["interactive"] == 0
                head = await asyncio.wait_for(reader.readline(), 30)  # a hang guard, not a bound
                assert b" 408 " in head
                writer.close()

        run(main())
    records = {x["status"]: x for x in map(json.loads, log.read_text().splitlines())}
    assert records[502]["e2e_ms"] < connect_timeout_s * 1000 / 4  # it did not wait for the connect timeout
    assert records[408]["reason"] == "body_timeout"
    assert records[408]["e2e_ms"] >= 300 - 2  # cut at the body timeout, not before it (uvloop's 1 ms timers)


def test_slow_upstream_bounded_by_first_byte_timeout(tmp_path):
    log = tmp_path / "req.jsonl"
    with ScheduleServer(ttft_ms=1500, itl_ms=10) as up, \
            GateProcess(up.base_url, "--first-byte-timeout-s", "0.4", jobs_dir=tmp_path / "jobs", log=log) as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                r = await stream_request(s, gate.url + "/v1/completions", {"prompt": "hi", "stream": True})
                assert r["status"] == 504
                r = await stream_request(s, gate.url + "/v1/completions", {"prompt": "hi"})
                assert r["status"] == 504

        run(main())
    # The gate's own times: it gave up at its 0.4 s timeout, before the upstream's first
    # byte (1.5 s) could have come.
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["status"] for x in records] == [504, 504]
    assert all(400 <= x["e2e_ms"] < 1500 for x in records), records


def test_full_queue_hands_off_to_async_when_configured(tmp_path):
    with ScheduleServer(ttft_ms=30, itl_ms=20, output_tokens=10) as up, \
            GateProcess(up.base_url, "--max-concurrency", "1", "--max-queue", "1", "--overflow", "async",
                        "--max-queue-wait-ms", "3000", jobs_dir=tmp_path / "jobs") as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                url = gate.url + "/v1/completions"
                results = await asyncio.gather(*(stream_request(s, url, {"prompt": "x", "stream": True})
                                                 for _ in range(4)))
                statuses = sorted(r["status"] for r in results)
                assert statuses == [200, 200, 202, 202], statuses
                ids = [r["body"]["id"] for r in results if r["status"] == 202]
                assert all(r["body"]["reason"] == "queue_full_interactive" for r in results if r["status"] == 202)
                for _ in range(100):
                    jobs = [(await get_json(s, f"{gate.url}/v1/async/{i}"))[1] for i in ids]
                    if all(j["status"] == "succeeded" for j in jobs):
                        break
                    await asyncio.sleep(0.05)
                assert all(j["result"]["usage"]["completion_tokens"] == 10 for j in jobs)

        run(main())
