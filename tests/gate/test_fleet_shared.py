"""Gate processes sharing limits through a real redis-server: SIGKILL of a gate, of Redis."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.gate.helpers import GateProcess, get_json, metric, run
from tierguard.bench.schedule_server import ScheduleServer

LIMIT = 4
LEASE_MS = 1000


async def _client_loop(s: aiohttp.ClientSession, url: str, stop: asyncio.Event, statuses: list) -> None:
    body = {"model": "m", "prompt": "flood", "stream": True, "max_tokens": 8}
    while not stop.is_set():
        try:
            async with s.post(url, json=body) as r:
                await r.read()
                statuses.append(r.status)
        except aiohttp.ClientError:
            statuses.append("gone")
            if stop.is_set():
                return
            await asyncio.sleep(0.05)


async def _shared_up(s: aiohttp.ClientSession, *gates: GateProcess, timeout_s: float = 30.0) -> None:
    """Wait until every gate says its shared state is up: on a loaded host a gate's first
    Redis call can time out, and until a renewal answers it admits within a local share."""
    deadline = time.monotonic() + timeout_s
    for g in gates:
        while not (await get_json(s, g.url + "/health"))[1]["shared_state"]["up"]:
            assert time.monotonic() < deadline, f"{g.url}: shared state never came up"
            await asyncio.sleep(0.05)


async def _watch_upstream(s: aiohttp.ClientSession, base: str, stop: asyncio.Event, rows: list) -> None:
    while not stop.is_set():
        rows.append((time.monotonic(), (await get_json(s, base + "/health"))[1]["active"]))
        await asyncio.sleep(0.02)


def test_two_gates_share_the_limit_and_a_killed_gates_slots_come_back_by_expiry(tmp_path, redis_server):
    flags = ("--max-concurrency", str(LIMIT), "--max-queue-wait-ms", "4000", "--shared-state", redis_server.url,
             "--lease-ms", str(LEASE_MS), "--health-interval-s", "5")
    with ScheduleServer(ttft_ms=30, itl_ms=20, output_tokens=8) as up, \
            GateProcess(up.base_url, *flags, jobs_dir=tmp_path / "a") as a, \
            GateProcess(up.base_url, *flags, jobs_dir=tmp_path / "b") as b:

        async def main():
            async with aiohttp.ClientSession() as s:
                await _shared_up(s, a, b)
                stop_a, stop_b, stop_watch = asyncio.Event(), asyncio.Event(), asyncio.Event()
                got_a, got_b, rows = [], [], []
                watch = asyncio.create_task(_watch_upstream(s, up.base_url, stop_watch, rows))
                # 3x the limit through each gate: 6x the fleet's capacity
                flood_a = [asyncio.create_task(_client_loop(s, a.url + "/v1/completions", stop_a, got_a))
                           for _ in range(3 * LIMIT)]
                flood_b = [asyncio.create_task(_client_loop(s, b.url + "/v1/completions", stop_b, got_b))
                           for _ in range(3 * LIMIT)]
                await asyncio.sleep(1.2)
                for _ in range(40):  # kill it while it holds slots (almost always at once)
                    held_by_a = await metric(s, a.url, "tierguard_gate_in_flight")
                    if held_by_a:
                        break
                    await asyncio.sleep(0.05)
                stop_a.set()
                a.kill()  # SIGKILL mid-flood: its leases stay in Redis until they expire
                killed = time.monotonic()
                await asyncio.gather(*flood_a)
                await asyncio.sleep(LEASE_MS / 1000 + 0.8)
                stop_b.set()
                await asyncio.gather(*flood_b)
                stop_watch.set()
                await watch
                expiries = await metric(s, b.url, "tierguard_gate_shared_lease_expiries_total")
                waits = await metric(s, b.url, "tierguard_gate_shared_slot_waits_total")
                health = (await get_json(s, up.base_url + "/health"))[1]
                return held_by_a, killed, rows, got_b, expiries, waits, health

        held_by_a, killed, rows, got_b, expiries, waits, health = run(main())
    # measured at the upstream: never more than the shared limit, whichever gate sent it
    assert health["max_active"] <= LIMIT, health
    assert max(n for _, n in rows) == LIMIT
    assert set(got_b) == {200}, got_b  # gate b's clients were all served (queued, within 4 s)
    assert waits > 0  # b's requests did wait for shared slots
    # a held slots when it died; b could not use them until they expired, then the upstream was full again
    assert held_by_a >= 1
    assert expiries >= 1
    # and the upstream ran the full limit again after the kill: a's slots came back by
    # expiry (b reaped them: its counter), not by a release. How soon is measured by
    # bench/fleet_shared_limits.py, not asserted in a unit test.
    assert any(n == LIMIT for t, n in rows if t > killed), rows[-60:]


def test_redis_killed_mid_run_fails_no_request_and_says_degraded(tmp_path, redis_server):
    flags = ("--max-concurrency", str(LIMIT), "--max-queue-wait-ms", "4000", "--shared-state", redis_server.url,
             "--lease-ms", "900", "--shared-timeout-ms", "50", "--health-interval-s", "5")
    with ScheduleServer(ttft_ms=30, itl_ms=20, output_tokens=8) as up, \
            GateProcess(up.base_url, *flags, jobs_dir=tmp_path / "g") as gate:

        async def main():
            async with aiohttp.ClientSession() as s:
                await _shared_up(s, gate)
                stop, statuses = asyncio.Event(), []
                flood = [asyncio.create_task(_client_loop(s, gate.url + "/v1/completions", stop, statuses))
                         for _ in range(2 * LIMIT)]
                await asyncio.sleep(0.6)
                before = len(statuses)
                redis_server.kill()
                await asyncio.sleep(1.0)
                status, health = await get_json(s, gate.url + "/health")
                fallback = await metric(s, gate.url, "tierguard_gate_shared_fallback_admissions_total")
                up_gauge = await metric(s, gate.url, "tierguard_gate_shared_state_up")
                redis_server.restart()
                for _ in range(50):
                    if (await get_json(s, gate.url + "/health"))[1]["shared_state"]["up"]:
                        break
                    await asyncio.sleep(0.1)
                recovered = (await get_json(s, gate.url + "/health"))[1]
                await asyncio.sleep(0.3)
                stop.set()
                await asyncio.gather(*flood)
                readded = await metric(s, gate.url, "tierguard_gate_shared_leases_readded_total")
                return before, statuses, status, health, fallback, up_gauge, recovered, readded

        before, statuses, status, health, fallback, up_gauge, recovered, readded = run(main())
        upstream = run(_health(up.base_url))
    assert before > 0 and set(statuses) == {200}, statuses  # no request failed because Redis died
    assert status == 200 and health["status"] == "degraded" and health["shared_state"]["up"] is False
    assert up_gauge == 0 and fallback > 0
    assert recovered["shared_state"]["up"] is True and recovered["status"] == "ok"
    assert readded >= 1  # what ran through the outage was written back to Redis
    assert upstream["max_active"] <= LIMIT  # one gate: its local share is the whole limit


async def _health(base: str) -> dict:
    async with aiohttp.ClientSession() as s:
        return (await get_json(s, base + "/health"))[1]
