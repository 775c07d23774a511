"""How far is `tierguard bench` from the truth, and what does it cost to measure?

Drives the known-schedule server (TTFT 50 ms, ITL 20 ms, 128 output tokens, a 500 ms
stall in every tenth request) at 1, 64, 256 and 1024 concurrent streams and compares
what tierguard reports with what the server actually did: the server logs the
CLOCK_MONOTONIC time of every write (`/truth`), the same clock the client uses.
Prints one JSON object. Goals: at 256 streams p99 TTFT within 15 ms and p99 per-token
ITL within 2 ms of the truth; at 1024 within 50 ms; every stall found within 5 ms of its
true length; < 2.5 ms client CPU per 128-token request. A level whose requests failed,
whose records do not all pair with the server's, in which no stall was injected, or whose
client flagged itself distorted (late sends, a lagging loop) did not measure the client's
accuracy: the run is `"valid": false` and the goals null.

    .venv/bin/python bench/client_accuracy.py [--levels 1,64,256,1024] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402

from tierguard.bench.config import BenchConfig
from tierguard.bench.runner import run_bench
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.common.percentile import percentile


def truth_rows(base_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(base_url + "/truth?reset=1", timeout=60) as r:
        return {row["id"]: row for row in json.loads(r.read())["requests"]}


def max_active(server: ScheduleServer) -> int:
    with urllib.request.urlopen(server.base_url + "/health", timeout=30) as r:
        return json.loads(r.read())["max_active"]


def _itl(times, tokens) -> np.ndarray:
    g = np.diff(np.asarray(times)) * 1000.0
    k = np.asarray(tokens[1:], dtype=float)
    return np.repeat(g / k, k.astype(int)) if g.size else g


def _stall(times) -> float:
    g = np.diff(np.asarray(times)) * 1000.0
    return float(g.max() - np.median(g))


E2EL_S = (50 + 127 * 20 + 500 / 10) / 1000  # mean true request duration


def level(server: ScheduleServer, streams: int, n_requests: int, workers: int, mode: str,
          http_client: str = "auto") -> dict:
    """closed: rate inf with max-concurrency = streams (waves start together);
    open: Poisson arrivals at streams / E2EL, so about `streams` are in flight."""
    truth_rows(server.base_url)  # drop the preflight probe
    rate = float("inf") if mode == "closed" else streams / E2EL_S
    cfg = BenchConfig(base_url=server.base_url, input_len=16, output_len=128, request_rate=rate,
                      max_concurrency=streams if mode == "closed" else None, seed=streams,
                      num_requests=n_requests, workers=workers, show_progress=False, timeout=120,
                      http_client=http_client)
    t = time.monotonic()
    res = run_bench(cfg)
    wall = time.monotonic() - t
    truth = truth_rows(server.base_url)
    pairs = [(r, truth[r.response_id]) for r in res.records if r.ok and r.response_id in truth]
    c_ttft = np.array([r.ttft_ms for r, _ in pairs])
    t_ttft = np.array([(tr["times"][0] - tr["arrival"]) * 1000.0 for _, tr in pairs])
    c_itl = np.concatenate([r.itl_samples_ms() for r, _ in pairs])
    t_itl = np.concatenate([_itl(tr["times"], tr["tokens"]) for _, tr in pairs])
    stalled = [(r, tr) for r, tr in pairs if tr["stalled"]]
    stall_err = [abs(r.stall_ms - _stall(tr["times"])) for r, tr in stalled]
    s = res.summary
    t0 = res.run_info["t0_monotonic"]
    # Where TTFT error comes from: client send delay, server accept/parse, client read delay.
    send_delay = np.array([(r.sent_s - r.scheduled_s) * 1000 for r, _ in pairs])
    accept = np.array([(tr["arrival"] - t0 - r.sent_s) * 1000 for r, tr in pairs])
    read_delay = np.array([(r.first_token_s + t0 - tr["times"][0]) * 1000 for r, tr in pairs])
    chunk_delay = np.concatenate([(np.asarray(r.chunk_times_s) + t0 - np.asarray(tr["times"])) * 1000 for r, tr in pairs])
    p99 = lambda a: percentile(a, 99)  # noqa: E731
    return {
        "mode": mode, "http_client": http_client, "streams": streams, "requests": n_requests, "workers": workers, "completed": s["completed"],
        "failed": s["failed"], "paired": len(pairs), "wall_s": round(wall, 2),
        "true_p99_ttft_ms": round(p99(t_ttft), 2), "tierguard_p99_ttft_ms": round(p99(c_ttft), 2),
        "p99_ttft_error_ms": round(p99(c_ttft) - p99(t_ttft), 2),
        "true_p50_ttft_ms": round(float(np.median(t_ttft)), 2), "tierguard_p50_ttft_ms": round(float(np.median(c_ttft)), 2),
        "p99_per_request_ttft_error_ms": round(p99(np.abs(c_ttft - t_ttft)), 2),
        "true_p99_itl_ms": round(p99(t_itl), 3), "tierguard_p99_itl_ms": round(p99(c_itl), 3),
        "p99_itl_error_ms": round(p99(c_itl) - p99(t_itl), 3),
        "true_p50_itl_ms": round(float(np.median(t_itl)), 3), "tierguard_p50_itl_ms": round(float(np.median(c_itl)), 3),
        "ttft_error_breakdown_p99_ms": {"client_send_delay": round(p99(send_delay), 2),
                                        "server_accept_and_parse": round(p99(accept), 2),
                                        "client_read_delay_first_token": round(p99(read_delay), 2)},
        "p99_client_read_delay_all_chunks_ms": round(p99(chunk_delay), 2),
        "max_concurrent_server_streams": max_active(server),
        "p99_connect_ms": s.get("p99_connect_ms"), "connections_opened": s.get("connections_opened"),
        "stalls_injected": len(stalled),
        "stalls_found_within_5ms": int(sum(e <= 5.0 for e in stall_err)),
        "max_stall_error_ms": round(max(stall_err), 2) if stall_err else None,
        "client_cpu_ms_per_request": round(s["client_cpu_ms_per_request"], 3),
        "client_cpu_util_max": round(s["client_cpu_util_max"], 2),
        "p99_loop_lag_ms": round(s["p99_loop_lag_ms"], 2),
        "client_distorted": s["client_distorted"], "distortion_reasons": s["distortion_reasons"],
    }


def judge(levels: list[dict]) -> dict:
    """Validity of the run and its goals (see the module docstring), judged per level."""
    v = Validity()
    for lv in levels:
        name = f"{lv['streams']} streams ({lv['mode']})"
        v.require(lv["failed"] == 0 and lv["completed"] == lv["requests"],
                  f"{name}: {lv['failed']} failed, {lv['completed']} of {lv['requests']} completed")
        v.require(lv["paired"] == lv["completed"], f"{name}: {lv['completed'] - lv['paired']} records not in the server's truth")
        v.require(lv["stalls_injected"] > 0, f"{name}: no stall injected: stall detection not measured")
        v.require(not lv["client_distorted"], f"{name}: the client flagged itself distorted: {lv['distortion_reasons']}")

    def at(n: int) -> list[dict]:
        return [lv for lv in levels if lv["streams"] == n]

    def within(rows: list[dict], ttft_ms: float, itl_ms: float) -> bool | None:
        if not rows:
            return None
        return all(abs(r["p99_ttft_error_ms"]) <= ttft_ms and abs(r["p99_itl_error_ms"]) <= itl_ms for r in rows)

    return {
        **v.as_dict(),
        "goal_256_streams_within_15ms_ttft_2ms_itl": v.goal(within(at(256), 15, 2)),
        "goal_1024_streams_within_50ms": v.goal(within(at(1024), 50, 50)),
        "goal_every_stall_within_5ms": v.goal(all(lv["stalls_found_within_5ms"] == lv["stalls_injected"] for lv in levels)),
        "goal_client_cpu_under_2_5ms": v.goal(all(lv["client_cpu_ms_per_request"] < 2.5 for lv in levels)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,64,256,1024")
    ap.add_argument("--waves", type=float, default=2.0, help="requests per level = waves × streams (≥ 20)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--modes", default="closed,open", help="closed (max-concurrency waves), open (Poisson)")
    ap.add_argument("--http-client", default="auto", choices=["auto", "aiohttp"])
    args = ap.parse_args()
    out = {"load_average_before": os.getloadavg(), "server": {"ttft_ms": 50, "itl_ms": 20, "output_tokens": 128, "stall_every": 10, "stall_ms": 500,
                      "tokens_per_chunk": args.tokens_per_chunk}, "levels": []}
    with ScheduleServer(ttft_ms=50, itl_ms=20, stall_every=10, stall_ms=500,
                        tokens_per_chunk=args.tokens_per_chunk) as server:
        for streams in [int(x) for x in args.levels.split(",")]:
            for mode in args.modes.split(","):
                n = max(20, int(args.waves * streams))
                out["levels"].append(level(server, streams, n, min(args.workers, streams), mode, args.http_client))
            print(json.dumps(out["levels"][-1]), flush=True, file=sys.stderr)
    out["load_average_after"] = os.getloadavg()
    out.update(judge(out["levels"]))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
