"""Does one careless client freeze everyone? Oversized prompts while 8 streams decode.

A real `tierguard serve --model tiny` subprocess; C streams decode
in a closed loop (ignore_eos, fixed max_tokens) for the whole run. The run alternates
two phases of equal length, `trials` times each: "quiet" (only the streams) and "flood"
(the streams plus N requests whose JSON body carries a prompt of SIZE MB of "x", sent
one every `--spacing-s`, bodies written in full as an ordinary client would). Measured:

- every stream's inter-token gaps (client side, between SSE data events) -> p50/p99
  per phase, and p99(flood) / p99(quiet) per trial pair (the target: <= 1.2);
- each oversized request: status and the time from its first byte sent to the status
  line received (target < 100 ms);
- GET /health every 50 ms in both phases: max and p99 latency (target < 50 ms);
- server RSS (its tokenizer worker processes included) every 100 ms: growth during the
  flood over the quiet level before it (target < 200 MB).

With the default body limit (it follows from max_model_len) the oversized requests are
refused from their Content-Length (413, body never parsed). `--server-args
"--max-body-bytes 64MiB"` lifts that limit to show the byte rule instead: the body is
read and parsed, then refused with a 400 before any tokenizer runs.

    .venv/bin/python bench/oversized_requests.py
    .venv/bin/python bench/oversized_requests.py --server-args "--max-body-bytes 64MiB"

Prints one JSON document. On a shared machine the absolute numbers move with the
neighbours' load; the ratios inside one run are what to compare. A run is `"valid"` only
if both phases of every pair measured stream gaps and /health, RSS was sampled, and every
oversized request was sent and refused (4xx): one the server accepted, or that got no
answer, did not test what the bench is about. Goals (null on an invalid run): the four
targets below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierguard.cli.serve import READY_PREFIX  # noqa: E402
from tierguard.common.percentile import percentile  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402


def _q(values: list[float], q: float) -> float:
    return percentile(values, 100 * q, empty=float("nan"))  # type: ignore[return-value]


class Phase:
    def __init__(self, name: str) -> None:
        self.name = name
        self.gaps: list[float] = []
        self.health: list[float] = []
        self.oversized: list[dict] = []
        self.rss: list[int] = []
        self.cpu_s: float = 0.0  # server CPU time (user + system) spent in this phase


async def _stream_forever(session: aiohttp.ClientSession, url: str, box: dict, max_tokens: int) -> None:
    """One closed-loop stream: every gap goes to the phase running when it was observed."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    while True:
        async with session.post(url + "/v1/completions", json=body) as r:
            last = None
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.monotonic()
                if last is not None:
                    box["phase"].gaps.append(now - last)
                last = now


async def _health_forever(session: aiohttp.ClientSession, url: str, box: dict) -> None:
    while True:
        t = time.monotonic()
        async with session.get(url + "/health") as r:
            await r.read()
        box["phase"].health.append(time.monotonic() - t)
        await asyncio.sleep(max(0.0, 0.05 - (time.monotonic() - t)))


async def _rss_forever(pid: int, box: dict) -> None:
    proc = psutil.Process(pid)
    while True:
        try:
            total = proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            total = 0
        box["phase"].rss.append(total)
        await asyncio.sleep(0.1)


async def _oversized(port: int, body: bytes) -> dict:
    """Raw socket: the headers, then the whole body (as any client sends it, written in the
    background); the time runs from the first byte sent to the status line received."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    async def send_body() -> None:
        view = memoryview(body)
        for i in range(0, len(body), 1 << 20):
            writer.write(view[i:i + (1 << 20)])
            await writer.drain()

    t0 = time.monotonic()
    writer.write(head)
    sending = asyncio.create_task(send_body())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 120)
        answered = time.monotonic() - t0
        rest = await asyncio.wait_for(reader.read(2000), 10)
    except (TimeoutError, ConnectionError) as exc:
        return {"status": None, "error": type(exc).__name__, "answer_ms": round((time.monotonic() - t0) * 1000, 2)}
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        writer.transport.abort()
    status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else None
    message = rest.split(b"\r\n\r\n", 1)[-1][:160].decode(errors="replace")
    return {"status": status, "answer_ms": round(answered * 1000, 2), "message": message}


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _send_oversized(port: int, size_mb: float, n: int, spacing_s: float) -> list[dict]:
    """The sender child: builds the body, says it is ready, waits for a line, then sends."""
    body = json.dumps({"prompt": "x" * int(size_mb * 1_000_000), "max_tokens": 4}).encode()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    sent = []
    for _ in range(n):
        sent.append(asyncio.create_task(_oversized(port, body)))
        await asyncio.sleep(spacing_s)
    return list(await asyncio.gather(*sent))


async def main(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "tierguard", "serve", "--model", args.model, "--port", "0",
           *shlex.split(args.server_args)]
    child = ReadyProcess(cmd, READY_PREFIX, grace_s=15)
    url = child.start(timeout_s=300).split()[0]
    port = int(url.rsplit(":", 1)[1])
    server = psutil.Process(child.pid)
    phases: list[Phase] = []
    box = {"phase": Phase("warmup")}
    try:
        conn = aiohttp.TCPConnector(limit=args.streams + 4)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            tasks = [asyncio.create_task(_stream_forever(s, url, box, args.max_tokens)) for _ in range(args.streams)]
            tasks += [asyncio.create_task(_health_forever(s, url, box)), asyncio.create_task(_rss_forever(child.pid, box))]
            await asyncio.sleep(args.warmup_s)
            for trial in range(args.trials):
                for name in ("quiet", "flood"):
                    sender = None
                    if name == "flood":
                        # A separate process sends them: this one's event loop times the streams,
                        # and must not also copy 300 MB of request bodies. It starts (and builds
                        # its body) before the phase does, so both phases last phase_s.
                        sender = await asyncio.create_subprocess_exec(
                            sys.executable, os.path.abspath(__file__), "--send-oversized", str(port),
                            str(args.size_mb), str(args.oversized), str(args.spacing_s),
                            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                        await sender.stdout.readline()
                    phase = Phase(f"{name}-{trial}")
                    phases.append(phase)
                    box["phase"] = phase
                    cpu0 = _cpu(server)
                    if sender is not None:
                        sender.stdin.write(b"go\n")
                        await sender.stdin.drain()
                    await asyncio.sleep(args.phase_s)
                    phase.cpu_s = _cpu(server) - cpu0
                    if sender is not None:
                        box["phase"] = Phase("between")  # gaps while the sender finishes are not counted
                        out, _ = await sender.communicate()
                        phase.oversized = json.loads(out)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        child.stop()
    return _report(args, phases)


def _report(args: argparse.Namespace, phases: list[Phase]) -> dict:
    out: dict = {"config": {k: v for k, v in vars(args).items()}, "phases": [], "pairs": []}
    for p in phases:
        out["phases"].append({
            "phase": p.name, "gaps": len(p.gaps),
            "itl_p50_ms": round(_q(p.gaps, 0.5) * 1000, 2), "itl_p99_ms": round(_q(p.gaps, 0.99) * 1000, 2),
            "health_n": len(p.health), "health_p99_ms": round(_q(p.health, 0.99) * 1000, 2),
            "health_max_ms": round(max(p.health, default=float("nan")) * 1000, 2),
            "rss_mb_start": round(p.rss[0] / 2**20, 1) if p.rss else None,
            "rss_mb_max": round(max(p.rss) / 2**20, 1) if p.rss else None,
            "server_cpu_s": round(p.cpu_s, 2),
            "oversized": p.oversized,
        })
    for i in range(0, len(phases) - 1, 2):
        quiet, flood = phases[i], phases[i + 1]
        answers = [o["answer_ms"] for o in flood.oversized]
        out["pairs"].append({
            "itl_p99_ratio_flood_over_quiet": round(_q(flood.gaps, 0.99) / _q(quiet.gaps, 0.99), 3),
            "oversized_statuses": sorted({o["status"] for o in flood.oversized}, key=str),
            "oversized_answer_ms_max": max(answers, default=None),
            "health_max_ms": round(max(quiet.health + flood.health) * 1000, 2),
            "rss_growth_mb": round((max(flood.rss) - quiet.rss[-1]) / 2**20, 1) if flood.rss and quiet.rss else None,
        })
    pairs = out["pairs"]
    v = Validity()
    v.require(bool(pairs), "no quiet/flood pair was run")
    for p in phases:
        v.require(bool(p.gaps) and bool(p.health), f"{p.name}: no stream gaps or /health samples")
        v.require(bool(p.rss), f"{p.name}: no RSS sample")
        if p.name == "flood":
            v.require(bool(p.oversized), "a flood phase sent no oversized request")
            bad = [o["status"] for o in p.oversized if not (isinstance(o["status"], int) and 400 <= o["status"] < 500)]
            v.require(not bad, f"oversized requests not refused with a 4xx: {bad}")
    if not v.valid:
        out.update(v.as_dict())
        return out
    out["summary"] = {
        "itl_p99_ratio_worst": max(p["itl_p99_ratio_flood_over_quiet"] for p in pairs),
        "oversized_answer_ms_max": max(p["oversized_answer_ms_max"] for p in pairs),
        "health_max_ms": max(p["health_max_ms"] for p in pairs),
        "rss_growth_mb_max": max(p["rss_growth_mb"] for p in pairs),
        "targets": {"itl_p99_ratio": 1.2, "oversized_answer_ms": 100, "health_ms": 50, "rss_growth_mb": 200},
    }
    s = out["summary"]
    out.update(v.as_dict())
    out["goals_met"] = v.goal(s["itl_p99_ratio_worst"] <= 1.2 and s["oversized_answer_ms_max"] <= 100
                              and s["health_max_ms"] <= 50 and s["rss_growth_mb_max"] <= 200)
    return out


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream request (closed loop)")
    p.add_argument("--oversized", type=int, default=10)
    p.add_argument("--size-mb", type=float, default=30.0)
    p.add_argument("--spacing-s", type=float, default=0.5, help="between oversized requests")
    p.add_argument("--phase-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--server-args", default="", help="extra flags for `tierguard serve`")
    return p.parse_args()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--send-oversized":  # the sender child process
        port, size_mb, n, spacing = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(asyncio.run(_send_oversized(port, size_mb, n, spacing))))
    else:
        print(json.dumps(asyncio.run(main(_parse())), indent=2))
