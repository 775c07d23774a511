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

Hygiene: both paths are warmed at the full concurrency first (the gate's upstream pool
then holds a connection per stream); direct, gate and a second direct run rotate within
each trial; the two direct pools give the NOISE FLOOR ("noise_floor_per_chunk_ms" =
direct_b - direct): an "added" figure within the noise floor is not the gate's.
`--pin` pins upstream + client to one core and the gate to another; `--gate-args`
passes flags to the gate (e.g. "--exact-token-count" to see what the byte bound saves).

    .venv/bin/python bench/gate_overhead.py --streams 1,100,500
Prints one JSON document. Goal: p99 added < 1 ms at 100 streams. "valid": false (goal
null) when a stream's chunks cannot be paired one to one with the server's writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierguard.bench.schedule_server import ScheduleServer  # noqa: E402
from tierguard.common.percentile import percentile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402


def _q(values: list[float], q: float) -> float:
    return percentile(values, 100 * q, empty=float("nan"))  # type: ignore[return-value]


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


async def _level(base: str, upstream: str, streams: int, rounds: int, tokens: int, itl: float,
                 ramp: float | None = None) -> dict:
    out: dict = {"ttft": [], "sched_late": [], "streams": {}, "unpaired": 0}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        await _truth(s, upstream)  # reset the server's record
        url = base + "/v1/completions"

        async def worker(k: int) -> None:
            await asyncio.sleep(k * (ramp or itl) / max(1, streams))  # spread starts (and chunk phases)
            for _ in range(rounds):
                await _stream(s, url, tokens, itl, out)

        await asyncio.gather(*(worker(k) for k in range(streams)))
        truth = await _truth(s, upstream)
    # delivery latency of every chunk: client arrival - server write (same CLOCK_MONOTONIC);
    # a stream whose id or chunk count does not match the server's record is not paired
    # (its chunks would be matched to the wrong writes) and makes the run invalid.
    out["delivery"] = []
    if truth:
        out["unpaired"] += streams * rounds - len(out["streams"])  # no request id seen
        for rid, arr in out["streams"].items():
            if len(truth.get(rid, ())) != len(arr):
                out["unpaired"] += 1
                continue
            out["delivery"].extend(a - w for a, w in zip(arr, truth[rid], strict=True))
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


def _start_gate(upstream: str, jobs_dir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "tierguard.cli.main", "gate", "--upstream", upstream, "--port", "0",
            "--max-concurrency", "4096", "--max-long", "4096", "--max-queue", "4096", "--jobs-dir", jobs_dir,
            *extra]
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
    p.add_argument("--ramp-ms", type=float, default=None,
                   help="spread stream starts over this long (default one ITL: a burst of arrivals; a longer "
                        "ramp with more --tokens measures steady streaming rather than the arrival burst)")
    p.add_argument("--pin", action="store_true", help="pin upstream + client to one core, the gate to another")
    p.add_argument("--client-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop of this client process (uvloop: less client CPU, a lower noise floor)")
    p.add_argument("--gate-args", default="", help="extra flags for the gate, e.g. '--exact-token-count'")
    p.add_argument("--nice", type=int, default=None,
                   help="scheduling priority of client, upstream and gate alike (e.g. -10 on a shared box; "
                        "needs privileges): separates the gate's own cost from other tenants' load")
    a = p.parse_args()
    if a.nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, a.nice)  # inherited by the upstream and the gate
        except PermissionError:
            print(f"cannot set priority {a.nice}; running at the default", file=sys.stderr)
            a.nice = None
    itl = a.itl_ms / 1000
    levels = []
    run = Validity()
    load0 = round(os.getloadavg()[0], 2)
    loop_factory = _loop_factory(a.client_loop)
    ramp = a.ramp_ms / 1000 if a.ramp_ms else None
    with ScheduleServer(ttft_ms=a.ttft_ms, itl_ms=a.itl_ms) as up, tempfile.TemporaryDirectory() as tmp:
        gate, gate_url = _start_gate(up.base_url, tmp, shlex.split(a.gate_args))
        pinned = _pin(up.proc.pid, gate.pid) if a.pin else None

        def level(base: str, n: int, rounds: int, tokens: int) -> dict:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                return runner.run(_level(base, up.base_url, n, rounds, tokens, itl, ramp))

        try:
            for n in (int(x) for x in a.streams.split(",")):
                for base in (up.base_url, gate_url):  # warm both paths at full concurrency
                    level(base, n, 1, 2)
                # the three runs rotate so load drift on a shared machine hits each alike
                modes = [("direct", up.base_url), ("gate", gate_url), ("direct_b", up.base_url)]
                pooled = {m: {"ttft": [], "sched_late": [], "delivery": []} for m, _ in modes}
                unpaired = dict.fromkeys(pooled, 0)
                gate_cpu, gate_sys = 0.0, 0.0
                for t in range(a.trials):
                    for mode, base in modes[t % 3:] + modes[:t % 3]:
                        cpu0, sys0 = _cpu_s(gate.pid), _sys_s(gate.pid)
                        got = level(base, n, a.rounds, a.tokens)
                        if mode == "gate":
                            gate_cpu += _cpu_s(gate.pid) - cpu0
                            gate_sys += _sys_s(gate.pid) - sys0
                        for k, v in pooled[mode].items():
                            v.extend(got[k])
                        unpaired[mode] += got["unpaired"]
                judge_level(run, n, a.rounds * a.trials, unpaired, pooled)
                direct, via, direct_b = (_summary(pooled[m]) for m in ("direct", "gate", "direct_b"))
                kind = "delivery" if all("delivery_p50_ms" in d for d in (direct, via, direct_b)) else "sched_late"
                added = _diff(via, direct, kind)
                levels.append({"streams": n, "measure": kind, "direct": _round(direct), "gate": _round(via),
                               "direct_b": _round(direct_b),
                               "added_per_chunk_ms": added,
                               # the same load run direct twice: differences this large are noise
                               "noise_floor_per_chunk_ms": _diff(direct_b, direct, kind),
                               "ttft_added_p50_ms": round(via["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
                               "ttft_added_p99_ms": round(via["ttft_p99_ms"] - direct["ttft_p99_ms"], 3),
                               "ttft_noise_p50_ms": round(direct_b["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
                               # CPU the gate spent per relayed chunk (request path included):
                               # contention-free cost, unlike wall-clock latency on a shared box
                               "gate_cpu_us_per_chunk": round(gate_cpu / max(1, via["chunks"]) * 1e6, 1),
                               # of which in the kernel (socket calls; 10 ms ticks, so rough at low
                               # counts): Python cannot shave this part
                               "gate_sys_us_per_chunk": round(gate_sys / max(1, via["chunks"]) * 1e6, 1),
                               "loadavg_1m": round(os.getloadavg()[0], 2)})
        finally:
            gate.terminate()
            gate.wait(10)
    at100 = next((lv for lv in levels if lv["streams"] == 100), None)
    print(json.dumps({
        "bench": "gate_overhead", "itl_ms": a.itl_ms, "tokens": a.tokens, "rounds": a.rounds, "trials": a.trials,
        "ramp_ms": a.ramp_ms, "client_loop": a.client_loop, "pinned": pinned, "gate_args": a.gate_args, "nice": a.nice,
        "cpus": os.cpu_count(), "loadavg_1m_at_start": load0,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2), "levels": levels,
        **run.as_dict(),
        "goal": "p99 added per chunk < 1 ms at 100 streams",
        "goal_met": None if at100 is None else run.goal(at100["added_per_chunk_ms"]["p99"] < 1.0),
    }, indent=2))


def judge_level(run: Validity, n: int, per_stream: int, unpaired: dict, pooled: dict) -> None:
    """A level is valid when every stream of every mode ran (a first chunk each) and was
    paired with the server's record of its writes."""
    for mode, bad in unpaired.items():
        run.require(bad == 0, f"{n} streams, {mode}: {bad} streams not paired with the server's writes")
        got = len(pooled[mode]["ttft"])
        run.require(got == n * per_stream, f"{n} streams, {mode}: {got} of {n * per_stream} streams delivered a chunk")


def _diff(a: dict, b: dict, kind: str) -> dict:
    return {k: round(a[f"{kind}_{k}_ms"] - b[f"{kind}_{k}_ms"], 3)
            for k in ("p50", "p99", "p999") if f"{kind}_{k}_ms" in a and f"{kind}_{k}_ms" in b}


def _loop_factory(name: str):
    if name == "uvloop":
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            print("uvloop not installed; the client uses asyncio", file=sys.stderr)
    return None


def _pin(upstream_pid: int, gate_pid: int) -> dict | None:
    """Upstream and this client on the first allowed core, the gate on the second: the
    gate never competes with the load it is measured against. None with < 2 cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    os.sched_setaffinity(0, {cores[0]})
    os.sched_setaffinity(upstream_pid, {cores[0]})
    os.sched_setaffinity(gate_pid, {cores[1]})
    return {"client": cores[0], "upstream": cores[0], "gate": cores[1]}


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process: /proc/PID/schedstat (nanoseconds) where Linux has it, since
    psutil's user+system tick in 10 ms steps (useless for a few dozen chunks)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


def _sys_s(pid: int) -> float:
    return psutil.Process(pid).cpu_times().system


def _round(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
