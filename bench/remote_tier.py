"""Two `tierguard serve` replicas on one Redis: a prefix prefilled on A is served to B from
the remote tier, and Redis killed mid-run costs no request.

1. A private `redis-server` (Debian package; `maxmemory` + `allkeys-lru`, as documented)
   and two replicas, A and B, both started with `--kv-remote-url` (B has no disk tier).
2. A answers requests with `--prefixes` long prefixes; their full blocks are written
   behind to Redis. B learns them from the journal (its `kv_remote_blocks` gauge).
3. On B, alternately: a request on one of A's prefixes plus a new question (staged from
   Redis: counted as `kv_remote_hits`), and a request on a fresh prefix of the same length
   plus a question (recomputed). Same process, same warm-up, interleaved: the TTFT ratio
   remote / recomputed is read within one run.
4. Redis is killed (SIGKILL) while requests on more of A's prefixes are in flight at B,
   then more are sent: no request may fail, `/health` must say "degraded", and every
   request sent after the kill must be counted as a recompute decision.

Prints JSON; "valid": false (and the ratio null) when a request failed, A did not write
the prefixes, B did not learn them, B loaded fewer blocks from Redis than the prefixes
hold, a load was abandoned at its deadline, or the kill phase broke its promises.

    .venv/bin/python bench/remote_tier.py [--prefix-tokens 1536] [--prefixes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tier_common import ms, scrape, serve, stream_completion, token_prompt  # noqa: E402
from validity import Validity, count_errors  # noqa: E402

from tierguard.common.redis_server import INSTALL_HINT, RedisServer, redis_server_path  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-tokens", type=int, default=1536)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--prefixes", type=int, default=3, help="prefixes measured each way on B")
    p.add_argument(
        "--kill-requests", type=int, default=4, help="requests in flight at the kill, and after it"
    )
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--threads", default="1", help="TIERGUARD_NUM_THREADS for the servers")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


async def _health(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/health") as r:
        return await r.json()


async def _wait_counter(session, url: str, name: str, want: float, timeout_s: float = 60.0) -> dict:
    """Scrape until counter `name` reaches `want` (write-behind and journal refresh are async)."""
    deadline = time.monotonic() + timeout_s
    counters = await scrape(session, url)
    while counters.get(name, 0) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        counters = await scrape(session, url)
    return counters


async def _run(a: argparse.Namespace, url_a: str, url_b: str, redis: RedisServer) -> dict:
    n, k, q = a.prefixes, a.kill_requests, a.question_tokens
    shared = [token_prompt(1000 + i, a.prefix_tokens) for i in range(n + 2 * k)]  # prefilled on A
    fresh = [token_prompt(2000 + i, a.prefix_tokens) for i in range(n)]  # never seen anywhere
    blocks_per_prefix = a.prefix_tokens // BLOCK
    errors: list[str] = []
    out: dict = {}

    def check(streams) -> list:
        errors.extend(s.error or f"{s.name}: no token" for s in streams if s.error or not s.events)
        return streams

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for url in (url_a, url_b):
            check([await stream_completion(session, url, "warmup", token_prompt(5, 64), 4)])
        for i, p in enumerate(shared):  # A prefills every prefix B will ask for
            check([await stream_completion(session, url_a, f"a{i}", p + token_prompt(3000 + i, q), 4)])
        want = len(shared) * blocks_per_prefix
        a_counters = await _wait_counter(session, url_a, "kv_remote_writes", want)
        b_known = await _wait_counter(session, url_b, "kv_remote_blocks", want)
        out["a"] = {k2: a_counters.get(k2) for k2 in ("kv_remote_writes", "kv_remote_write_bytes")}
        out["b_known_blocks_before"] = b_known.get("kv_remote_blocks")

        remote_ttft, recompute_ttft = [], []
        for i in range(n):  # interleaved on B: remote, recomputed, remote, ...
            s = check([await stream_completion(session, url_b, f"remote{i}", shared[i] + token_prompt(4000 + i, q),
                                               a.output_tokens)])[0]  # fmt: skip
            remote_ttft.append(ms(s.ttft_s))
            s = check([await stream_completion(session, url_b, f"fresh{i}", fresh[i] + token_prompt(5000 + i, q),
                                               a.output_tokens)])[0]  # fmt: skip
            recompute_ttft.append(ms(s.ttft_s))
        b = await scrape(session, url_b)
        out["b_measured"] = {
            key: b.get(key)
            for key in ("kv_remote_hits", "kv_blocks_loaded_from_remote", "kv_remote_read_bytes", "kv_remote_misses",
                        "kv_remote_errors", "kv_tier_recomputes", "kv_transfer_remote_to_host_p50_ms",
                        "kv_transfer_remote_to_host_p99_ms")
        }  # fmt: skip
        out["remote_ttft_ms"], out["recompute_ttft_ms"] = remote_ttft, recompute_ttft
        out["health_before_kill"] = (await _health(session, url_b))["status"]

        # Redis killed while k requests on known-remote prefixes are in flight at B
        before = await scrape(session, url_b)
        during = [
            asyncio.create_task(stream_completion(session, url_b, f"kill{i}", shared[n + i] + token_prompt(6000 + i, q),
                                                  a.output_tokens))
            for i in range(k)
        ]  # fmt: skip
        await asyncio.sleep(0.01)
        redis.kill()
        killed_at = time.perf_counter()
        during_streams = check(await asyncio.gather(*during))
        after_kill = [
            check([await stream_completion(session, url_b, f"after{i}",
                                           shared[n + k + i] + token_prompt(7000 + i, q), a.output_tokens)])[0]
            for i in range(k)
        ]  # fmt: skip
        fresh_after_kill = [  # plain recomputes under the same conditions, for comparison
            check([await stream_completion(session, url_b, f"fresh-after{i}",
                                           token_prompt(9000 + i, a.prefix_tokens + q), a.output_tokens)])[0]
            for i in range(k)
        ]  # fmt: skip
        for i in range(k):  # A keeps serving too
            check([await stream_completion(session, url_a, f"a-after{i}", token_prompt(8000 + i, 256), 4)])
        health = await _health(session, url_b)
        end = await scrape(session, url_b)
        delta = {key: end.get(key, 0) - before.get(key, 0) for key in
                 ("kv_contract_interactive_recompute", "kv_staging_failures_interactive", "kv_remote_hits",
                  "kv_remote_errors", "kv_remote_unavailable", "kv_tier_recomputes")}  # fmt: skip
        out["kill"] = {
            "requests_in_flight_at_kill": k,
            "requests_after_kill": k,
            "in_flight_ttft_ms": [ms(s.ttft_s) for s in during_streams],
            "after_kill_ttft_ms": [ms(s.ttft_s) for s in after_kill],
            "fresh_prefix_after_kill_ttft_ms": [ms(s.ttft_s) for s in fresh_after_kill],
            "seconds_from_kill_to_last_answer": round(time.perf_counter() - killed_at, 3),
            "health_after_kill": health.get("status"),
            "remote_reason": (health.get("kv_tiers") or {}).get("remote_reason"),
            "counter_deltas": delta,
            "kv_remote_healthy": end.get("kv_remote_healthy"),
        }
    out["errors"] = errors
    return out


def report(a: argparse.Namespace, got: dict) -> dict:
    """The run's validity, TTFT figures and goal, from what `_run` measured."""
    n, k, per = a.prefixes, a.kill_requests, a.prefix_tokens // BLOCK
    b, kill = got["b_measured"], got["kill"]
    v = Validity()
    v.require(not got["errors"], count_errors(got["errors"]))
    v.require(
        (got["a"]["kv_remote_writes"] or 0) >= (n + 2 * k) * per, f"replica A wrote {got['a']} to Redis"
    )
    v.require((got["b_known_blocks_before"] or 0) >= (n + 2 * k) * per, "replica B did not learn A's blocks")
    v.require(
        (b["kv_remote_hits"] or 0) >= n * per,
        f"B loaded {b['kv_remote_hits']} blocks from Redis, < {n * per}",
    )
    v.require(
        not b["kv_tier_recomputes"], "a remote load missed its deadline: the 'remote' TTFT is a recompute"
    )
    v.require(got["health_before_kill"] == "ok", f"/health before the kill: {got['health_before_kill']}")
    v.require(kill["health_after_kill"] == "degraded", f"/health after the kill: {kill['health_after_kill']}")
    decided = kill["counter_deltas"]["kv_contract_interactive_recompute"]
    v.require(decided >= k, f"{decided} recompute decisions counted for {k} requests sent after the kill")
    remote_med, rec_med = _median(got["remote_ttft_ms"]), _median(got["recompute_ttft_ms"])
    ratio = round(remote_med / rec_med, 3) if v.valid and remote_med and rec_med else None
    result = {
        "prefix_tokens": a.prefix_tokens,
        "prefixes": n,
        "remote_median_ttft_ms": remote_med,
        "recompute_median_ttft_ms": rec_med,
        "ttft_ratio_remote_to_recompute": ratio,
        "goal_ratio_below_0_5": v.goal(ratio is not None and ratio < 0.5),
        **got,
        **v.as_dict(),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if redis_server_path() is None:
        print(json.dumps({"valid": False, "invalid_reasons": [INSTALL_HINT]}, indent=2))
        return 0
    env = {"TIERGUARD_NUM_THREADS": a.threads}
    base = ["--device", a.device, "--max-model-len", "2048", "--kv-cache-gib", "0.05",
            "--max-num-batched-tokens", "512", "--kv-host-gib", "0.05"]  # fmt: skip
    with RedisServer(maxmemory="256mb") as redis:
        tiers = ["--kv-remote-url", redis.url, "--kv-remote-timeout-ms", "50"]
        with (
            serve("remote_tier_a", base + tiers, env) as url_a,
            serve("remote_tier_b", base + tiers, env) as url_b,
        ):
            got = asyncio.run(_run(a, url_a, url_b, redis))
    result = report(a, got)
    print(json.dumps(result, indent=2))
    return 0


def _median(values: list[float | None]) -> float | None:
    got = [x for x in values if x is not None]
    return statistics.median(got) if got else None


if __name__ == "__main__":
    raise SystemExit(main())
