"""Slowloris against the gate: do 500 sockets that never finish their headers cost anyone?

A real `tierguard gate` in front of the schedule server (known
TTFT). Two phases of the same normal load (`--requests` streaming completions one after
another, TTFT measured at the client): "quiet", then "attack" while `--sockets`
connections each send a partial request line and then one more header byte every
`--trickle-s` seconds, never the blank line. After the attack phase the bench waits
for the slow sockets to be closed and reports when each one was, counted from its
connect (expected: the header timeout, `--header-timeout-s`), what it received (a 408),
and the gate's header-timeout counter from /metrics.

    .venv/bin/python bench/slow_headers_gate.py
Prints one JSON document. Targets: TTFT p50/p99 under attack within 1.2x of quiet; every
slow socket closed at the header timeout. The run is `"valid"` only if the attack was one:
every slow socket connected and was still open when the attack phase's requests had all
been answered, and every one was closed by the gate (not by this client); else the goals
are null.
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
from tierguard.bench.schedule_server import ScheduleServer  # noqa: E402
from tierguard.common.percentile import percentile  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402


def judge(out: dict, sockets: int, header_timeout_s: float) -> dict:
    v = Validity()
    slow = out["slow_sockets"]
    v.require(slow["n"] == sockets, f"{slow['n']} of {sockets} slow sockets ran")
    v.require(out["attack"]["all_sockets_still_open"], "a slow socket closed before the attack phase ended")
    v.require(out["quiet"]["n"] > 0 and out["attack"]["n"] == out["quiet"]["n"], "the phases ran different loads")
    closed_by_gate = all(a.startswith("HTTP/1.1 408") for a in slow["answers"])
    v.require(closed_by_gate, f"slow sockets ended otherwise than by the gate's 408: {slow['answers']}")
    return {
        **v.as_dict(),
        "goal_ttft_within_1_2x": v.goal(out["ttft_ratio_p50"] <= 1.2 and out["ttft_ratio_p99"] <= 1.2),
        "goal_closed_at_header_timeout": v.goal(header_timeout_s <= slow["closed_after_s_min"]
                                                and slow["closed_after_s_max"] <= header_timeout_s + 2),
    }


def _q(values: list[float], q: float) -> float:
    return percentile(values, 100 * q, empty=float("nan"))  # type: ignore[return-value]


async def _ttfts(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.monotonic()
            async with s.post(url + "/v1/completions", json={"prompt": "hello", "stream": True, "max_tokens": 8}) as r:
                first = None
                async for chunk in r.content.iter_any():
                    if first is None and b"data: {" in chunk:
                        first = time.monotonic() - t0
                if r.status != 200 or first is None:
                    raise RuntimeError(f"normal request failed: {r.status}")
                out.append(first)
    return out


async def _slow_socket(port: int, trickle_s: float, result: list) -> None:
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\nX-Slow: ")

    async def trickle() -> None:
        while True:
            await asyncio.sleep(trickle_s)
            writer.write(b"a")
            await writer.drain()

    task = asyncio.create_task(trickle())
    try:
        data = await reader.read()  # until the gate closes the connection
        result.append({"closed_after_s": time.monotonic() - t0, "answer": data[:12].decode(errors="replace")})
    except ConnectionError as exc:
        result.append({"closed_after_s": time.monotonic() - t0, "answer": type(exc).__name__})
    finally:
        task.cancel()
        writer.transport.abort()


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def main(args: argparse.Namespace) -> dict:
    up = ScheduleServer(ttft_ms=args.ttft_ms, itl_ms=5, output_tokens=8).start()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tierguard", "gate", "--upstream", up.base_url, "--port", "0",
               "--jobs-dir", tmp + "/jobs", "--header-timeout-s", str(args.header_timeout_s)]
        gate = ReadyProcess(cmd, "READY ", grace_s=5, stderr_path=tmp + "/gate.err")
        try:
            port = int(gate.start(30).split()[0])
            url = f"http://127.0.0.1:{port}"
            await _ttfts(url, 5)  # warm-up: connections to the upstream, first-request costs
            quiet = await _ttfts(url, args.requests)
            closed: list[dict] = []
            sockets_t0 = time.monotonic()
            slow = [asyncio.create_task(_slow_socket(port, args.trickle_s, closed)) for _ in range(args.sockets)]
            await asyncio.sleep(0.5)  # all connected and trickling
            attack = await _ttfts(url, args.requests)
            attack_end_s = time.monotonic() - sockets_t0  # must be < the header timeout to mean anything
            await asyncio.wait_for(asyncio.gather(*slow), args.header_timeout_s + 30)
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                metrics = await r.text()
        finally:
            gate.stop()
            up.stop()
    after = [c["closed_after_s"] for c in closed]
    ms = 1000.0
    out = {
        "config": vars(args),
        "quiet": {"n": len(quiet), "ttft_p50_ms": _q(quiet, 0.5) * ms, "ttft_p99_ms": _q(quiet, 0.99) * ms},
        "attack": {"n": len(attack), "ttft_p50_ms": _q(attack, 0.5) * ms, "ttft_p99_ms": _q(attack, 0.99) * ms,
                   "ended_s_after_sockets_opened": round(attack_end_s, 2),
                   "all_sockets_still_open": attack_end_s < min(after, default=0)},
        "ttft_ratio_p50": round(_q(attack, 0.5) / _q(quiet, 0.5), 3),
        "ttft_ratio_p99": round(_q(attack, 0.99) / _q(quiet, 0.99), 3),
        "slow_sockets": {"n": len(closed), "closed_after_s_min": round(min(after), 3),
                         "closed_after_s_p50": round(_q(after, 0.5), 3), "closed_after_s_max": round(max(after), 3),
                         "answers": sorted({c["answer"] for c in closed})},
        "gate_header_timeouts_total": _metric(metrics, "tierguard_gate_http_header_timeouts_total"),
        "targets": {"ttft_ratio": 1.2, "closed_after_s": args.header_timeout_s},
    }
    return {**out, **judge(out, args.sockets, args.header_timeout_s)}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", type=int, default=500)
    p.add_argument("--requests", type=int, default=40, help="normal requests per phase, one after another")
    p.add_argument("--header-timeout-s", type=float, default=10.0, help="the gate's flag (10 is its default)")
    p.add_argument("--trickle-s", type=float, default=1.0, help="one more header byte this often")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="the upstream's scheduled TTFT")
    return p.parse_args()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(_parse())), indent=2))
