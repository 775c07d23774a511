"""Two gates sharing `--max-concurrency 8` through Redis, flooded at 4x capacity; one is SIGKILLed.

Measured at the upstream (the schedule server counts the streams it serves; its own
`max_active` is exact, and its `/health` is sampled every 10 ms): it must never run
more than the fleet limit, although each gate alone would admit that many. Mid-flood
one gate is killed with SIGKILL while it holds slots; the other gate cannot use them
until their leases expire, so the time from the kill until the upstream runs the full
limit again must be at most the lease time (the leases were renewed at most a lease ago)
plus `--slack-ms` for the survivor to notice, forward, and for the 10 ms sampling.

    .venv/bin/python bench/fleet_shared_limits.py [--seconds 8 --kill-at 4 --lease-ms 2000]

Open-loop arrivals (fixed rate, independent of answers) split evenly between the gates.
Capacity = limit / service time of one request (ttft + itl x (tokens-1)).

"valid": false when redis-server is missing, a request through the surviving gate got
anything but 200 or 429 or an admitted stream was cut short, nobody got a 429 (the flood
was no overload), or the killed gate held no slot when it died (nothing to come back).
Client, gates, Redis and upstream share this machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402

from tierguard.bench.schedule_server import ScheduleServer  # noqa: E402
from tierguard.bench.scrape import parse_metrics  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402
from tierguard.common.redis_server import INSTALL_HINT, RedisServer, redis_server_path  # noqa: E402


async def _one(s: aiohttp.ClientSession, url: str, tokens: int) -> dict:
    body = {"model": "m", "prompt": "flood", "stream": True, "max_tokens": tokens}
    t0 = time.monotonic()
    try:
        async with s.post(url, json=body) as r:
            data = await r.read()
            out = {"status": r.status, "sent": t0, "e2e": time.monotonic() - t0}
            if r.status == 200:
                out["complete"] = data.rstrip().endswith(b"data: [DONE]") and data.count(b"data: ") == tokens + 1
            return out
    except aiohttp.ClientError as exc:
        return {"status": "gone", "sent": t0, "error": type(exc).__name__}


async def _sum_metric(s: aiohttp.ClientSession, base: str, name: str) -> float:
    async with s.get(base + "/metrics") as r:
        samples = parse_metrics(await r.text())
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


async def _run(a: argparse.Namespace, upstream: str, gates: list[str], killer) -> dict:
    service_s = (a.ttft_ms + a.itl_ms * (a.tokens - 1)) / 1000
    rate = a.overload * a.limit / service_s
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
        samples: list[tuple[float, int]] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                async with s.get(upstream + "/health") as r:
                    samples.append((time.monotonic(), (await r.json())["active"]))
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        tasks: list[tuple[int, asyncio.Task]] = []
        start = time.monotonic()
        killed_at = None
        held_at_kill = None
        i = 0
        while (due := start + i / rate) < start + a.seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if killed_at is None and time.monotonic() - start >= a.kill_at:
                held_at_kill = await _sum_metric(s, gates[0], "tierguard_gate_in_flight")
                if held_at_kill or time.monotonic() - start >= a.kill_at + 1:  # kill it holding slots
                    killer()
                    killed_at = time.monotonic()
            g = i % 2
            if not (g == 0 and killed_at is not None):  # nothing more is sent to the dead gate
                tasks.append((g, asyncio.create_task(_one(s, gates[g] + "/v1/completions", a.tokens))))
            i += 1
        results = [(g, await t) for g, t in tasks]
        await asyncio.sleep(0.2)
        stop.set()
        await watcher
        async with s.get(upstream + "/health") as r:
            upstream_health = await r.json()
        survivor = {name: await _sum_metric(s, gates[1], "tierguard_gate_" + name)
                    for name in ("shared_lease_expiries_total", "shared_slot_waits_total",
                                 "shared_fallback_admissions_total", "shared_errors_total")}
    after = [(t - killed_at, n) for t, n in samples if killed_at is not None and t >= killed_at]
    back = next((t for t, n in after if n >= a.limit), None)
    low = min((n for t, n in after if back is None or t < back), default=None)
    return {"rate_rps": round(rate, 1), "capacity_rps": round(a.limit / service_s, 1), "service_s": service_s,
            "results": results, "samples": samples, "killed_at": killed_at, "start": start,
            "held_by_killed_gate": held_at_kill, "slots_back_s": back, "upstream_low_after_kill": low,
            "upstream": upstream_health, "survivor": survivor}


def report(a: argparse.Namespace, r: dict) -> dict:
    """The run's validity, its figures and goals, from what `_run` recorded."""
    v = Validity()
    results, killed_at, start, samples = r["results"], r["killed_at"], r["start"], r["samples"]
    survivor = [x for g, x in results if g == 1]
    odd = sorted({str(x["status"]) for x in survivor} - {"200", "429"})
    v.require(not odd, f"the surviving gate answered {odd} (only 200 or 429 are right)")
    v.require(all(x.get("complete") for x in survivor if x["status"] == 200), "an admitted stream was cut short")
    v.require(any(x["status"] == 429 for _, x in results), "nobody got a 429: the flood was not an overload")
    v.require((r["held_by_killed_gate"] or 0) >= 1, "the killed gate held no slot: nothing had to come back")
    v.require(r["slots_back_s"] is not None, "the upstream never ran the full limit again after the kill")
    killed_gate_before = [x for g, x in results if g == 0 and x["sent"] < killed_at]
    statuses: dict = {}
    for g, x in results:
        key = f"gate{g}_{'before' if x['sent'] < killed_at else 'after'}_kill"
        statuses.setdefault(key, {}).setdefault(str(x["status"]), 0)
        statuses[key][str(x["status"])] += 1
    sampled_max = max(n for _, n in samples)
    return {
        **v.as_dict(),
        "rate_rps": r["rate_rps"], "capacity_rps": r["capacity_rps"], "requests": len(results),
        "statuses": statuses, "killed_gate_requests_before_kill": len(killed_gate_before),
        "upstream_max_in_flight": r["upstream"]["max_active"], "upstream_sampled_max_in_flight": sampled_max,
        "upstream_samples": len(samples),
        "held_by_killed_gate_at_kill": r["held_by_killed_gate"],
        "upstream_low_after_kill": r["upstream_low_after_kill"],
        "slots_back_s": None if r["slots_back_s"] is None else round(r["slots_back_s"], 3),
        "lease_s": a.lease_ms / 1000,
        "survivor_counters": r["survivor"],
        "goal_upstream_never_above_limit": v.goal(r["upstream"]["max_active"] <= a.limit),
        "slack_s": a.slack_ms / 1000,
        "goal_slots_back_within_lease_plus_slack": v.goal(r["slots_back_s"] is not None
                                                          and r["slots_back_s"] <= (a.lease_ms + a.slack_ms) / 1000),
        "admitted_rps_after_kill": round(sum(1 for g, x in results if x["sent"] >= killed_at and x["status"] == 200)
                                         / max(1e-9, a.seconds - (killed_at - start)), 1),
        "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=8, help="--max-concurrency shared by both gates")
    p.add_argument("--overload", type=float, default=4.0, help="arrival rate as a multiple of capacity")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--kill-at", type=float, default=4.0, help="seconds into the flood when gate 0 is SIGKILLed")
    p.add_argument("--lease-ms", type=int, default=2000)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--max-queue-wait-ms", type=float, default=1000.0)
    p.add_argument("--slack-ms", type=float, default=100.0,
                   help="allowance for the survivor's wake-up, its forward and one 10 ms sample")
    a = p.parse_args()
    v = Validity()
    out: dict = {"bench": "fleet_shared_limits", "limit": a.limit, "overload": a.overload, "seconds": a.seconds,
                 "kill_at_s": a.kill_at, "lease_ms": a.lease_ms}
    if not v.require(redis_server_path() is not None, INSTALL_HINT):
        print(json.dumps({**out, **v.as_dict()}, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="tierguard-shared-") as tmp, RedisServer() as redis, \
            ScheduleServer(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms) as up:
        flags = ["--max-concurrency", str(a.limit), "--max-queue", "64",
                 "--max-queue-wait-ms", str(a.max_queue_wait_ms), "--shared-state", redis.url,
                 "--lease-ms", str(a.lease_ms), "--health-interval-s", "5"]
        gates = []
        for g in range(2):
            child = ReadyProcess([sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", up.base_url,
                                  "--port", "0", "--jobs-dir", os.path.join(tmp, f"jobs{g}"), *flags], "READY ",
                                 stderr_path=os.path.join(tmp, f"gate{g}.err"), grace_s=5.0)
            gates.append((child, f"http://127.0.0.1:{int(child.start(30).split()[0])}"))
        try:
            r = asyncio.run(_run(a, up.base_url, [u for _, u in gates], gates[0][0].kill))
        finally:
            for child, _ in gates:
                child.stop()
    out.update(report(a, r))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
