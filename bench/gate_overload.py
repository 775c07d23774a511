"""A flood at 3x the upstream's capacity through `tierguard gate`: TTFT of the admitted, RSS.

The speed and memory targets of the overload test (tests/gate/test_overload.py checks
the behaviour: 200 or 429 with Retry-After, refusals by the queue's rules only).
Open-loop arrivals at `--overload` times what the schedule server can serve, twice: a
warm-up flood (allocator and pools grow), then the measured one. Reports the admitted
requests' p99 TTFT seen by this client against the budget (max queue wait + upstream
TTFT + `--slack-ms`), the longest queue wait of an admitted request and the longest
answer to a refused one in the gate's own request log against `--max-wait-ms` (plus
`--late-share` of it for a busy event loop), and the gate's RSS growth between the two
floods.

    .venv/bin/python bench/gate_overload.py [--seconds 20]

"valid": false (goals null) when a request raised, got a status other than 200/429, or
streamed an incomplete answer, or the flood was not an overload (nobody got a 429).
Client, gate and upstream share this machine: on a loaded box the TTFT includes CPU
contention between them.
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
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402

from tierguard.bench.schedule_server import ScheduleServer  # noqa: E402
from tierguard.common.percentile import percentile  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402


async def _one(s: aiohttp.ClientSession, url: str, i: int, tokens: int) -> dict:
    body = {"model": "m", "prompt": f"request {i}", "stream": True, "max_tokens": tokens}
    t0 = time.monotonic()
    out: dict = {"ttft": None}
    async with s.post(url, json=body) as r:
        out["status"] = r.status
        if r.status == 200:
            data = b""
            async for chunk in r.content.iter_any():
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - t0
                data += chunk
            out["complete"] = data.rstrip().endswith(b"data: [DONE]") and data.count(b"data: ") == tokens + 1
        else:
            await r.read()
    return out


async def _flood(url: str, rate: float, duration_s: float, tokens: int) -> list:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        start, tasks, i = time.monotonic(), [], 0
        while (due := start + i / rate) < start + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(_one(s, url, i, tokens)))
            i += 1
        return await asyncio.gather(*tasks, return_exceptions=True)


def _check(results: list, v: Validity, name: str) -> list[dict]:
    raised = [r for r in results if isinstance(r, BaseException)]
    v.require(not raised, f"{name}: {len(raised)} requests raised ({raised[:2]!r})")
    done = [r for r in results if isinstance(r, dict)]
    odd = sorted({r["status"] for r in done} - {200, 429})
    v.require(not odd, f"{name}: statuses other than 200/429: {odd}")
    v.require(all(r["complete"] for r in done if r["status"] == 200), f"{name}: an admitted stream was cut short")
    v.require(any(r["status"] == 429 for r in done), f"{name}: nobody got a 429 - the flood was not an overload")
    v.require(any(r["status"] == 200 for r in done), f"{name}: nobody was served")
    return done


def _log_lines(path: str, skip: int = 0, want: int = 0) -> list[dict]:
    """The gate's request log after its first `skip` lines; waits (bounded) until it holds
    `want` of them: a stream's line is written just after its last byte went out."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[skip:]
        except FileNotFoundError:
            lines = []
        if len(lines) >= want or time.monotonic() > deadline:
            return [json.loads(x) for x in lines]
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="length of the measured flood")
    p.add_argument("--capacity", type=int, default=4)
    p.add_argument("--overload", type=float, default=3.0, help="arrival rate as a multiple of capacity")
    p.add_argument("--ttft-ms", type=float, default=40.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=500.0)
    p.add_argument("--slack-ms", type=float, default=500.0, help="loopback and scheduling allowance in the budget")
    p.add_argument("--late-share", type=float, default=0.5,
                   help="how late the gate's loop may record a deadline, as a share of --max-wait-ms")
    a = p.parse_args()
    service_s = (a.ttft_ms + a.itl_ms * (a.tokens - 1)) / 1000
    rate = a.overload * a.capacity / service_s
    budget_ms = a.max_wait_ms + a.ttft_ms + a.slack_ms
    v = Validity()
    with ScheduleServer(capacity=a.capacity, ttft_ms=a.ttft_ms, itl_ms=a.itl_ms) as up, \
            tempfile.TemporaryDirectory() as tmp:
        gate = ReadyProcess([sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", up.base_url,
                             "--port", "0", "--jobs-dir", tmp, "--max-concurrency", str(a.capacity),
                             "--max-queue", "8", "--max-queue-wait-ms", str(a.max_wait_ms),
                             "--log", os.path.join(tmp, "gate.jsonl")], "READY ",
                            stderr_path=os.path.join(tmp, "gate.err"))
        with gate:
            url = f"http://127.0.0.1:{int(gate.start(30).split()[0])}/v1/completions"
            proc = psutil.Process(gate.pid)
            warm = _check(asyncio.run(_flood(url, rate, a.seconds / 2, a.tokens)), v, "warm-up")
            rss_before = proc.memory_info().rss
            logged = _log_lines(os.path.join(tmp, "gate.jsonl"), want=len(warm))
            done = _check(asyncio.run(_flood(url, rate, a.seconds, a.tokens)), v, "measured")
            rss_after = proc.memory_info().rss
            records = _log_lines(os.path.join(tmp, "gate.jsonl"), skip=len(logged), want=len(done))
    ttfts = sorted(r["ttft"] for r in done if r["status"] == 200 and r["ttft"] is not None)
    p99_ms = 1000 * percentile(ttfts, 99) if ttfts else None  # type: ignore[operator]
    growth_mib = (rss_after - rss_before) / 2**20
    waits = [x["queue_wait_ms"] for x in records if x["status"] == 200 and x.get("queue_wait_ms") is not None]
    refusals = [x["e2e_ms"] for x in records if x["status"] == 429 and x.get("e2e_ms") is not None]
    wait_bound_ms = a.max_wait_ms * (1 + a.late_share)
    v.require(len(records) == len(done), f"the gate logged {len(records)} of {len(done)} requests")
    print(json.dumps({
        "bench": "gate_overload", "seconds": a.seconds, "rate_rps": round(rate, 1), "capacity": a.capacity,
        "requests": len(done), "admitted": sum(r["status"] == 200 for r in done),
        "rejected": sum(r["status"] == 429 for r in done), **v.as_dict(),
        "p99_ttft_admitted_ms": None if p99_ms is None else round(p99_ms, 1), "ttft_budget_ms": budget_ms,
        "goal_p99_ttft_within_budget": v.goal(p99_ms is not None and p99_ms < budget_ms),
        "max_queue_wait_admitted_ms": round(max(waits), 1) if waits else None,
        "max_answer_refused_ms": round(max(refusals), 1) if refusals else None, "wait_bound_ms": wait_bound_ms,
        "goal_waits_within_the_limit": v.goal(bool(waits) and max(waits) <= wait_bound_ms
                                              and max(refusals, default=0.0) <= wait_bound_ms),
        "rss_growth_mib": round(growth_mib, 2),
        "goal_rss_growth_under_16_mib": v.goal(growth_mib < 16),
        "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
