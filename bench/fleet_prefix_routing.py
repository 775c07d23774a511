"""Multi-turn chats through `tierguard gate` over two `tierguard serve` replicas: --route prefix vs round-robin.

What prefix-aware routing buys: a chat's next turn lands where its earlier turns were
prefilled, so the replica's prefix cache serves them. Measured on the replicas (their own
`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`, in prompt tokens, summed over both)
and at the client (TTFT through the gate, p50/p99), side by side.

    .venv/bin/python bench/fleet_prefix_routing.py [--chats 12 --turns 4 --concurrency 4]

The same workload for both variants (R10): the same chats in the same order and the same
concurrency; the assistant turns the client sends back are fixed texts (never what the model
generated), so every prompt is identical across variants; fresh replicas for each variant
(empty caches), each warmed with one unrelated request first. Every chat has its own
document (no prefix shared between chats), so any hit is a chat's own earlier turns.

"valid": false when a request failed or was cut short, the variants did not send the same
prompt tokens, or the prefix variant routed no turn by prefix. Client, gate and replicas share
this machine's CPUs: compare the variants as ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity, count_errors  # noqa: E402

from tierguard.bench.scrape import parse_metrics  # noqa: E402
from tierguard.bench.stats import describe  # noqa: E402
from tierguard.common.proc import ReadyProcess  # noqa: E402

SERVE_READY = "tierguard serve: ready on "
WORDS = ("pump valve reactor coolant pressure sensor alarm loop shaft seal bearing motor relay panel "
         "fuse gauge filter intake outlet turbine boiler vent duct fan blade rotor stator winding").split()


def _chats(n: int, turns: int, doc_words: int, seed: int) -> list[list[dict]]:
    """Per chat, the message list of each turn (turn t holds turns 0..t); deterministic."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        doc = " ".join(rng.choice(WORDS) for _ in range(doc_words))
        msgs = [{"role": "system", "content": f"Manual {c}. Answer from it only.\n{doc}"}]
        per_turn = []
        for t in range(turns):
            question = f"Question {t} about manual {c}: " + " ".join(rng.choice(WORDS) for _ in range(40))
            msgs = msgs + [{"role": "user", "content": question}]
            per_turn.append(list(msgs))
            msgs = msgs + [{"role": "assistant", "content": f"Answer {t}: " + " ".join(rng.choice(WORDS)
                                                                                      for _ in range(20))}]
        out.append(per_turn)
    return out


def _start(args: list[str], prefix: str, stderr: str) -> ReadyProcess:
    child = ReadyProcess(args, prefix, stderr_path=stderr, grace_s=10.0)
    child.ready_text = child.start(300)  # type: ignore[attr-defined]
    return child


def _start_all(specs: list[tuple[list[str], str, str]]) -> list[ReadyProcess]:
    """Start children in parallel threads (model loading dominates), fail if any failed."""
    out: list = [None] * len(specs)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            out[i] = _start(*specs[i])
        except RuntimeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for c in out:
            if c is not None:
                c.stop()
        raise RuntimeError(errors[0])
    return out


async def _metrics(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with s.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


async def _turn(s: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    out: dict = {"ttft": None, "error": None}
    try:
        async with s.post(url, json=body) as r:
            out["status"], out["replica"] = r.status, r.headers.get("X-Tierguard-Replica")
            out["route"] = r.headers.get("X-Tierguard-Route")
            data = b""
            async for chunk in r.content.iter_any():
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - t0
                data += chunk
    except aiohttp.ClientError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    events = [e[6:] for e in data.decode(errors="replace").split("\n\n") if e.startswith("data: ")]
    usage = next((json.loads(e)["usage"] for e in events if e != "[DONE]" and '"usage"' in e
                  and json.loads(e).get("usage")), None)
    out["complete"] = r.status == 200 and events[-1:] == ["[DONE]"] and usage is not None \
        and usage["completion_tokens"] == max_tokens
    if usage is not None:
        out["prompt_tokens"] = usage["prompt_tokens"]
        out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if r.status != 200:
        out["error"] = f"status {r.status}: {data[:200]!r}"
    return out


async def _workload(gate_url: str, replicas: list[str], chats: list[list[dict]], concurrency: int,
                    max_tokens: int, think_s: float) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        for base in replicas:  # warm each replica (kernels, allocator) with a prompt no chat shares
            warm = await _turn(s, base + "/v1/chat/completions",
                               [{"role": "user", "content": "warm up " * 50}], max_tokens)
            if warm["error"]:
                raise RuntimeError(f"warm-up on {base} failed: {warm['error']}")
        before = [await _metrics(s, b) for b in replicas]
        sem = asyncio.Semaphore(concurrency)
        results: list[dict] = []

        async def chat(turns: list[list[dict]], pauses: list[float]) -> None:
            async with sem:
                for turn, (messages, pause) in enumerate(zip(turns, pauses, strict=True)):
                    await asyncio.sleep(pause)  # the user reads and types: turns of chats interleave
                    res = await _turn(s, gate_url + "/v1/chat/completions", messages, max_tokens)
                    results.append({**res, "turn": turn})  # each turn after the previous answer

        rng = random.Random(len(chats))  # the same pauses for every variant
        pauses = [[rng.uniform(0, think_s) for _ in turns] for turns in chats]
        t0 = time.monotonic()
        await asyncio.gather(*(chat(t, w) for t, w in zip(chats, pauses, strict=True)))
        wall = time.monotonic() - t0
        after = [await _metrics(s, b) for b in replicas]
        gate_metrics = await _metrics(s, gate_url)
    hits = sum(_sum(a, "vllm:prefix_cache_hits_total") - _sum(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before, strict=True))
    queries = sum(_sum(a, "vllm:prefix_cache_queries_total") - _sum(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before, strict=True))
    ok = [r for r in results if r["error"] is None and r.get("complete")]
    routed: dict[str, float] = {}
    for k, v in gate_metrics.items():
        if k.startswith("tierguard_gate_routed_total{"):
            reason = k.split('reason="')[1].split('"')[0]
            routed[reason] = routed.get(reason, 0) + v
    per_replica = {str(i): sum(r.get("replica") == str(i) for r in results) for i in range(len(replicas))}
    return {
        "requests": len(results), "ok": len(ok), "wall_s": round(wall, 2),
        "errors": [r["error"] or "incomplete" for r in results if r not in ok],
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in results),
        "cached_tokens_reported": sum(r.get("cached_tokens", 0) for r in results),
        **{k: (round(v, 2) if v is not None else None)
           for k, v in describe([r["ttft"] * 1000 for r in ok], "ttft_ms").items()},
        # turns after the first: the only ones routing can help (a first turn is cold everywhere)
        **{k: (round(v, 2) if v is not None else None) for k, v in describe(
            [r["ttft"] * 1000 for r in ok if r["turn"] > 0], "followup_ttft_ms").items()
           if k.split("_")[0] in ("median", "p99", "mean")},
        "routed_by_reason": routed, "requests_per_replica": per_replica,
    }


def _variant(route: str, a: argparse.Namespace, chats: list, tmp: str) -> dict:
    serve = [sys.executable, "-m", "tierguard.cli.main", "serve", "--model", "tiny", "--port", "0",
             "--max-model-len", "4096", "--enable-prompt-tokens-details"]
    replicas = _start_all([(serve, SERVE_READY, os.path.join(tmp, f"{route}-r{i}.err")) for i in range(2)])
    try:
        urls = [c.ready_text.split()[0] for c in replicas]  # type: ignore[attr-defined]
        gate_args = [sys.executable, "-m", "tierguard.cli.main", "gate", "--port", "0", "--route-headers", "--route", route,
                     "--jobs-dir", os.path.join(tmp, f"jobs-{route}"), "--max-concurrency", "64",
                     "--health-interval-s", "0.5", "--first-byte-timeout-s", "300",
                     *[x for u in urls for x in ("--upstream", u)]]
        gate = _start(gate_args, "READY ", os.path.join(tmp, f"gate-{route}.err"))
        try:
            gate_url = f"http://127.0.0.1:{int(gate.ready_text.split()[0])}"  # type: ignore[attr-defined]
            return asyncio.run(_workload(gate_url, urls, chats, a.concurrency, a.max_tokens, a.think_ms / 1000))
        finally:
            gate.stop()
    finally:
        for c in replicas:
            c.stop()


def judge(out: dict) -> dict:
    """Adds the run's validity, the TTFT ratios and the goal to `out` (both variants run)."""
    v = Validity()
    for route, res in out["variants"].items():
        v.require(not res["errors"], f"{route}: " + count_errors(res["errors"]))
    pre, rr = out["variants"]["prefix"], out["variants"]["round-robin"]
    v.require(pre["prompt_tokens"] == rr["prompt_tokens"] and pre["prompt_tokens"] > 0,
              f"the variants sent different prompt tokens ({pre['prompt_tokens']} vs {rr['prompt_tokens']})")
    v.require(pre["routed_by_reason"].get("prefix_hit", 0) > 0, "the prefix variant routed no turn by prefix")
    v.require(bool(pre["prefix_cache_query_tokens"]) and bool(rr["prefix_cache_query_tokens"]),
              "a replica reported no prefix-cache queries: the hit rate is not measured")
    out.update(v.as_dict())
    if pre["median_ttft_ms"] and rr["median_ttft_ms"]:
        out["ttft_p50_ratio_prefix_over_rr"] = round(pre["median_ttft_ms"] / rr["median_ttft_ms"], 3)
        out["ttft_p99_ratio_prefix_over_rr"] = round(pre["p99_ttft_ms"] / rr["p99_ttft_ms"], 3)
        out["followup_ttft_p50_ratio_prefix_over_rr"] = round(pre["median_followup_ttft_ms"]
                                                              / rr["median_followup_ttft_ms"], 3)
        out["followup_ttft_p99_ratio_prefix_over_rr"] = round(pre["p99_followup_ttft_ms"]
                                                              / rr["p99_followup_ttft_ms"], 3)
    hit_p, hit_r = pre["prefix_cache_hit_rate"], rr["prefix_cache_hit_rate"]
    out["goal_prefix_hit_rate_above_round_robin"] = v.goal(hit_p is not None and hit_r is not None and hit_p > hit_r)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="chats in progress at once")
    p.add_argument("--doc-words", type=int, default=400, help="words in each chat's own document")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn (ignore_eos)")
    p.add_argument("--think-ms", type=float, default=300.0, help="longest pause before a turn (uniform, seeded)")
    p.add_argument("--seed", type=int, default=13)
    a = p.parse_args()
    chats = _chats(a.chats, a.turns, a.doc_words, a.seed)
    out: dict = {"bench": "fleet_prefix_routing", "chats": a.chats, "turns": a.turns, "concurrency": a.concurrency,
                 "doc_words": a.doc_words, "max_tokens": a.max_tokens, "think_ms": a.think_ms, "replicas": 2,
                 "variants": {}}
    with tempfile.TemporaryDirectory(prefix="tierguard-fleet-") as tmp:
        for route in ("prefix", "round-robin"):
            out["variants"][route] = _variant(route, a, chats, tmp)
    judge(out)
    out.update(cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
