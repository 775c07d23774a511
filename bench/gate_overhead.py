"""Per-chunk latency the gate adds, versus talking to the upstream directly.

Method (preferred, "delivery"): the schedule server records the CLOCK_MONOTONIC time
of every chunk it writes (GET /truth); this client records when each chunk arrives on
the same clock. delivery = arrival - write, per chunk. The same load runs direct and
through the gate at each concurrency; "added" is the difference of the delivery
percentiles (gate - direct). The one-off request path (token counting, admission,
connecting) is reported separately as added TTFT.
Fallback when the server has no /truth ("sched_late"): lateness of chunk i >= 1
against the known schedule, anchored at the stream's first chunk: t_i - t_0 - i * itl.
Upstream, gate and this client are three processes on one machine, so at high
concurrency the figure includes CPU contention between them — compare within one run.

    .venv/bin/python bench/gate_overhead.py --streams 1,100,500
Prints one JSON document. Goal: p99 added < 1 ms at 100 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierguard.bench.schedule_server import ScheduleServer  # noqa: E402


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


_REQ_ID = re.compile(rb'"id": ?"(req-\d+)"')


async def _stream(s: aiohttp.ClientSession, url: str, tokens: int, itl: float, out: dict) -> None:
    body = {"model": "m", "prompt": "hello gate", "stream": True, "max_tokens": tokens}
    sent = time.perf_counter()
    arrivals: list[float] = []  # time.monotonic() of each content event at this client
    req_id = None
    async with s.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"status {r.status}: {await r.text()}")
        async for chunk in r.content.iter_any():
            now_mono, now = time.monotonic(), time.perf_counter()
            n = chunk.count(b"data: {")  # content events; [DONE] is not one
            if n and req_id is None:
                out["ttft"].append(now - sent)
                m = _REQ_ID.search(chunk)
                req_id = m.group(1).decode() if m else None
            arrivals.extend([now_mono] * n)
    # fallback measure: lateness against the schedule, anchored at the first chunk
    out["sched_late"].extend(t - (arrivals[0] + i * itl) for i, t in enumerate(arrivals) if i)
    if req_id is not None:
        out["streams"][req_id] = arrivals


async def _level(base: str, upstream: str, streams: int, rounds: int, tokens: int, itl: float) -> dict:
    out: dict = {"ttft": [], "sched_late": [], "streams": {}}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        await _truth(s, upstream)  # reset the server's record
        url = base + "/v1/completions"

        async def worker(k: int) -> None:
            await asyncio.sleep(k * itl / max(1, streams))  # spread chunk phases over one ITL
            for _ in range(rounds):
                await _stream(s, url, tokens, itl, out)

        await asyncio.gather(*(worker(k) for k in range(streams)))
        truth = await _truth(s, upstream)
    # delivery latency of every chunk: client arrival - server write (same CLOCK_MONOTONIC)
    out["delivery"] = [a - w for rid, arr in out["streams"].items() if rid in truth
                       for a, w in zip(arr, truth[rid], strict=False)]
    del out["streams"]
    return out


def _summary(samples: dict) -> dict:
    ms = 1000.0
    res = {"chunks": len(samples["sched_late"]) + len(samples["ttft"]),
           "ttft_p50_ms": _q(samples["ttft"], 0.5) * ms, "ttft_p99_ms": _q(samples["ttft"], 0.99) * ms,
           "sched_late_p50_ms": _q(samples["sched_late"], 0.5) * ms,
           "sched_late_p99_ms": _q(samples["sched_late"], 0.99) * ms}
    if samples["delivery"]:
        d = samples["delivery"]
        res.update({"delivery_p50_ms": _q(d, 0.5) * ms, "delivery_p99_ms": _q(d, 0.99) * ms,
                    "delivery_p999_ms": _q(d, 0.999) * ms, "delivery_chunks": len(d)})
    return res


async def _truth(s: aiohttp.ClientSession, upstream: str) -> dict[str, list[float]]:
    """The schedule server's record of write times per request, when it offers one."""
    async with s.get(upstream + "/truth?reset=1") as r:
        if r.status != 200:
            return {}
        data = await r.json()
    return {row["id"]: row["times"] for row in data.get("requests", [])}


def _start_gate(upstream: str, jobs_dir: str) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", upstream, "--port", "0",
            "--max-concurrency", "4096", "--max-long", "4096", "--max-queue", "4096", "--jobs-dir", jobs_dir]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError("gate did not start")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,100,500")
    p.add_argument("--rounds", type=int, default=1, help="streams each client worker runs back to back")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--trials", type=int, default=3, help="alternating direct/gate runs pooled per level")
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=50.0)
    a = p.parse_args()
    itl = a.itl_ms / 1000
    levels = []
    with ScheduleServer(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms) as up, tempfile.TemporaryDirectory() as tmp:
        gate, gate_url = _start_gate(up.base_url, tmp)
        try:
            for n in (int(x) for x in a.streams.split(",")):
                for base in (up.base_url, gate_url):  # warm both paths
                    asyncio.run(_level(base, up.base_url, min(n, 8), 1, 4, itl))
                # direct and gate runs alternate so load drift on a shared machine hits both
                pooled = {m: {"ttft": [], "sched_late": [], "delivery": []} for m in ("direct", "gate")}
                gate_cpu = 0.0
                for _ in range(a.trials):
                    for mode, base in (("direct", up.base_url), ("gate", gate_url)):
                        cpu0 = _cpu_s(gate.pid)
                        got = asyncio.run(_level(base, up.base_url, n, a.rounds, a.tokens, itl))
                        if mode == "gate":
                            gate_cpu += _cpu_s(gate.pid) - cpu0
                        for k, v in pooled[mode].items():
                            v.extend(got[k])
                direct, via = _summary(pooled["direct"]), _summary(pooled["gate"])
                kind = "delivery" if "delivery_p50_ms" in direct and "delivery_p50_ms" in via else "sched_late"
                added = {k: round(via[f"{kind}_{k}_ms"] - direct[f"{kind}_{k}_ms"], 3)
                         for k in ("p50", "p99", "p999") if f"{kind}_{k}_ms" in direct}
                levels.append({"streams": n, "measure": kind, "direct": _round(direct), "gate": _round(via),
                               "added_per_chunk_ms": added,
                               "ttft_added_p50_ms": round(via["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
                               # CPU the gate spent per relayed chunk (request path included):
                               # contention-free cost, unlike wall-clock latency on a shared box
                               "gate_cpu_us_per_chunk": round(gate_cpu / max(1, via["chunks"]) * 1e6, 1)})
        finally:
            gate.terminate()
            gate.wait(10)
    at100 = next((lv for lv in levels if lv["streams"] == 100), None)
    print(json.dumps({
        "bench": "gate_overhead", "itl_ms": a.itl_ms, "tokens": a.tokens, "rounds": a.rounds, "trials": a.trials,
        "cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "levels": levels,
        "goal": "p99 added per chunk < 1 ms at 100 streams",
        "goal_met": None if at100 is None else at100["added_per_chunk_ms"]["p99"] < 1.0,
    }, indent=2))


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _round(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
