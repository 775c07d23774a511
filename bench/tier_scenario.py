"""The article's scenario, sized from the server's own step times: four chats and one long request.

Four chats run several turns each (every turn re-sends the history plus a few new
tokens, then the user thinks before the next); as the chats' first turns end, one long
request with a long answer arrives. The same request profile (same token ids, output
lengths, greedy, EOS ignored, same arrival offsets and think times, one warm-up request)
is run against three real `tierguard serve` subprocesses:

  reference  device pool large enough for everything, no tiers
  contract   device pool too small to hold them all; host-RAM and NVMe tiers on
  naive      the same small pool and tiers with --kv-naive-sync-disk (running sequences
             spill to disk and are read back synchronously inside the step)

Sizing. The tiers are only tested when chat prefixes leave the device pool before the
chats' next turns reuse them, and when that happens depends on how fast the CPU is. So
a probe server first measures, from its own step log, the prefill time per token
(prefill-only steps) and the decode step time with one row per chat plus the long
request; `size_scenario` turns them and the token counts into:

  small pool   the long request's prompt plus two chats' final histories (the article's
               "the small pool holds the long one plus two chats"), never more than what
               leaves chat prefixes in the pool once the long prompt is in;
  long arrival after the chats' first turns (1.5x their estimate: never on the edge,
               where its prompt would land beside their decodes in one run and not
               in the next);
  think time   the chats return twice the long prompt's prefill time after it arrived:
               after it is in the pool, so their prefixes come back from the tiers;
  long answer  long enough to keep decoding through the chats' remaining turns, and
               short enough that the long request fits the small pool on its own.

Every derived value and the measurements behind it are printed in "scenario"; each one
has a CLI override. `--repeats N` runs reference, contract, naive in alternation N
times; each variant reports the median over runs of its p99 ITL, and every run's value
and tier counters. Goals: median contract p99 ITL within 1.25x the reference's, median
naive p99 ITL at least 1.5x it. The JSON is "valid": false (and the goals null) when a
stream failed or came back empty, or any run of a tiered variant did not use its tiers
(EXERCISED: counters that must be non-zero).

    .venv/bin/python bench/tier_scenario.py [--repeats 3] [--model tiny] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tier_common import ms, pct, scrape, serve, stream_completion, token_prompt  # noqa: E402
from validity import Validity, count_errors  # noqa: E402

from tierguard.serve.step_log import read_step_log  # noqa: E402

COUNTERS = (
    "kv_host_hits kv_disk_hits kv_tier_misses kv_blocks_loaded kv_blocks_loaded_from_disk "
    "kv_swap_out_blocks kv_swap_recompute_blocks kv_offloaded_blocks kv_persisted_blocks "
    "kv_tier_recomputes kv_async_handoffs kv_staging_deadline_misses_interactive "
    "kv_disk_reads_in_decode kv_naive_reads_in_decode kv_naive_spills kv_naive_sync_reads kv_naive_stall_ms "
    "kv_disk_write_errors kv_disk_healthy kv_transfer_queue_depth kv_load_p99_ms "
    "kv_transfer_device_to_host_p99_ms kv_transfer_host_to_device_p99_ms kv_block_evictions"
).split()
# What each variant must show in /metrics for its numbers to mean anything: per variant,
# groups of counters of which at least one must be > 0 (a missing counter counts as 0).
EXERCISED: dict[str, list[tuple[tuple[str, ...], str]]] = {
    "contract": [
        (("kv_swap_out_blocks", "kv_offloaded_blocks"), "no block left the device pool: it was never short"),
        (("kv_host_hits", "kv_disk_hits"), "no host- or disk-tier hit: the tiers were never read"),
    ],
    "naive": [
        (("kv_naive_spills",), "no running sequence was spilled to disk"),
        (("kv_naive_sync_reads",), "no synchronous disk read inside the step"),
    ],
}
CONTRACT_GOAL = 1.25  # median contract p99 ITL at most this times the reference's
NAIVE_GOAL = 1.5  # median naive p99 ITL at least this times the reference's
THINK_MARGIN = 2.0  # the chats return this many long-prompt prefill times after the long arrives
ARRIVAL_MARGIN = 1.5  # the long request arrives this many times the chats' first turns' estimate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (built in) or smollm2, as `tierguard serve --model`")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of every variant")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-context", type=int, default=256, help="first-turn prompt tokens of a chat")
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-user-tokens", type=int, default=32, help="tokens added per turn")
    p.add_argument("--chat-output", type=int, default=48)
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument(
        "--long-class",
        default="batch",
        choices=["batch", "interactive"],
        help="request class of the long request (document analysis: batch by default)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--threads", default="1", help="TIERGUARD_NUM_THREADS for the servers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", default="reference,contract,naive")
    p.add_argument("--disk-dir", default=None, help="NVMe tier parent dir (default: a temp dir)")
    p.add_argument("--step-logs", default=None, help="keep every server's step log in this directory")
    # Derived from the probe unless given (see size_scenario).
    p.add_argument("--long-output", type=int, default=None)
    p.add_argument("--long-delay", type=float, default=None, help="seconds after the chats start")
    p.add_argument("--think", type=float, default=None, help="seconds between a chat's turns")
    p.add_argument("--small-blocks", type=int, default=None, help="device pool of the tiered variants")
    p.add_argument("--big-blocks", type=int, default=None, help="device pool of the reference")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--decode-step-ms", type=float, default=None, help="skip the probe: decode step time")
    p.add_argument("--prefill-us-per-token", type=float, default=None, help="skip the probe: prefill rate")
    p.add_argument("--block-bytes", type=int, default=None, help="skip the probe: KV bytes per block")
    return p.parse_args(argv)


class Measured(NamedTuple):
    """What the probe server's step log says about this CPU and model."""

    decode_step_s: float  # decode-only step with one row per chat plus the long request
    prefill_s_per_token: float  # prefill-only steps
    block_bytes: int  # KV bytes per block, all layers


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def size_scenario(a: argparse.Namespace, m: Measured) -> dict:
    """The scenario's pools, arrival, think time and long answer from token counts and
    measured step times (pure; a CLI value given in `a` wins over the derived one).

    Guarantees, whatever the measurements: the small pool cannot hold the long request
    beside every chat's final history, holds the long request on its own, and cannot
    keep every chat's first turn once the long prompt is in (it pushes chat prefixes
    out); the big pool holds everything.
    """
    bs, d, pp = a.block_size, m.decode_step_s, m.prefill_s_per_token
    reserve = a.chats + 1  # the scheduler keeps one free block per running sequence
    chat_first = a.chat_context + a.chat_output  # a chat's tokens after its first turn
    chat_final = a.chat_context + (a.chat_turns - 1) * (a.chat_output + a.chat_user_tokens) + a.chat_output
    first_turns_s = a.chats * a.chat_context * pp + a.chat_output * d
    turn_s = (a.chat_output + a.chat_user_tokens) * pp + a.chat_output * d  # later turns: prefix cached
    long_prefill_s = a.long_prompt * pp
    long_delay_s = a.long_delay if a.long_delay is not None else ARRIVAL_MARGIN * first_turns_s
    think_s = a.think if a.think is not None else long_delay_s - first_turns_s + THINK_MARGIN * long_prefill_s
    long_blocks = _blocks(a.long_prompt, bs)
    small = a.small_blocks
    if small is None:
        small = long_blocks + 2 * _blocks(chat_final, bs) + reserve
        # The long prompt must push chat prefixes out (one block per chat at least).
        small = min(small, long_blocks + a.chats * (_blocks(chat_first, bs) - 1) + reserve)
    long_output = a.long_output
    if long_output is None:
        rest_s = (a.chat_turns - 1) * (think_s + turn_s)
        room = (small - reserve - long_blocks) * bs  # the long request fits the pool on its own
        long_output = max(a.chat_output, min(math.ceil(rest_s / d), room))
    long_total = a.long_prompt + long_output
    everything = _blocks(long_total, bs) + a.chats * _blocks(chat_final, bs)
    big = a.big_blocks if a.big_blocks is not None else everything + reserve + 8  # + the warm-up
    max_len = a.max_model_len or _blocks(max(long_total, chat_final) + bs, bs) * bs
    return {
        "measured": {
            "decode_step_ms": round(1000 * d, 3),
            "prefill_us_per_token": round(1e6 * pp, 2),
            "block_bytes": m.block_bytes,
        },
        "small_blocks": small,
        "big_blocks": big,
        "everything_blocks": everything,
        "long_prompt_plus_two_chats_blocks": long_blocks + 2 * _blocks(chat_final, bs),
        "host_blocks": everything,  # host RAM could hold every block: the disk tier is behind it
        "long_output": long_output,
        "long_delay_s": round(long_delay_s, 4),
        "think_s": round(think_s, 4),
        "max_model_len": max_len,
        "estimates_s": {
            "chats_first_turns": round(first_turns_s, 4),
            "chat_later_turn": round(turn_s, 4),
            "long_prefill": round(long_prefill_s, 4),
            "long_decode": round(long_output * d, 4),
        },
    }


def profile(a: argparse.Namespace) -> tuple[list[list[list[int]]], list[int]]:
    """Chat turns (each the full history so far) and the long prompt; fixed by seed."""
    chats = []
    for c in range(a.chats):
        history = token_prompt(1000 + c, a.chat_context)
        turns = []
        for t in range(a.chat_turns):
            if t:
                history = history + token_prompt(2000 + 10 * c + t, a.chat_output + a.chat_user_tokens)
            turns.append(list(history))
        chats.append(turns)
    return chats, token_prompt(9999, a.long_prompt)


def step_summary(path: Path | None) -> dict:
    """What the server's steps took: the slowest decode-only and mixed steps, preemptions."""
    if path is None or not path.exists():
        return {}
    _, steps = read_step_log(path)
    decode = [s["duration"] for s in steps if s["token_rows"] and not s["chunks"]]
    mixed = [s["duration"] for s in steps if s["token_rows"] and s["chunks"]]
    return {
        "steps": len(steps),
        "p99_decode_only_step_ms": ms(pct(decode, 99)),
        "p99_step_with_decodes_and_prefill_ms": ms(pct(mixed, 99)),
        "steps_with_decodes_and_prefill": len(mixed),
        "prefill_tokens_beside_decodes": sum(s["chunk_tokens"] for s in steps if s["token_rows"] and s["chunks"]),
        "preempted": sum(s["preempted"] for s in steps),
    }


async def drive(url: str, a: argparse.Namespace, sc: dict) -> dict:
    chats, long_prompt = profile(a)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_completion(session, url, "warmup", token_prompt(5, 64), 8)

        async def chat(turns: list[list[int]], c: int) -> list:
            out = []
            for t, p in enumerate(turns):
                if t:
                    await asyncio.sleep(sc["think_s"])
                out.append(await stream_completion(session, url, f"chat{c}", p, a.chat_output))
            return out

        async def long() -> list:
            await asyncio.sleep(sc["long_delay_s"])
            return [
                await stream_completion(
                    session, url, "long", long_prompt, sc["long_output"], request_class=a.long_class
                )
            ]

        results = await asyncio.gather(*(chat(t, c) for c, t in enumerate(chats)), long())
        streams = [s for group in results for s in group]
        counters = await scrape(session, url)
        blocks = await scrape(session, url, prefix="tierguard:kv_blocks_total")
    itl = [g for s in streams for g in s.itls_s]
    chat_itl = [g for s in streams if s.name.startswith("chat") for g in s.itls_s]
    ttft = [s.ttft_s for s in streams if s.ttft_s is not None]
    long_s = next(s for s in streams if s.name == "long")
    top = sorted(((g, s.name) for s in streams for g in s.itls_s), reverse=True)[: max(1, len(itl) // 100)]
    return {
        "requests": len(streams),
        "errors": [s.error for s in streams if s.error],
        "empty_streams": sum(1 for s in streams if not s.error and not s.events),
        "kv_blocks_total": blocks.get("tierguard:kv_blocks"),
        "p50_ttft_ms": ms(pct(ttft, 50)),
        "p99_ttft_ms": ms(pct(ttft, 99)),
        "long_ttft_ms": ms(long_s.ttft_s),
        "p50_itl_ms": ms(pct(itl, 50)),
        "p99_itl_ms": ms(pct(itl, 99)),
        "max_itl_ms": ms(max(itl) if itl else None),
        "p99_itl_chats_ms": ms(pct(chat_itl, 99)),
        "p99_itl_long_ms": ms(pct(long_s.itls_s, 99)),
        # Whose gaps set the p99: the largest 1% of all gaps, by stream (the long request's
        # include the time it spent swapped out to host RAM when preempted).
        "top_1pct_itl_gaps": {
            "count": len(top),
            "of_long": sum(1 for _, n in top if n == "long"),
            "long_largest_ms": [ms(g) for g, n in top if n == "long"][:5],
            "chats_largest_ms": [ms(g) for g, n in top if n != "long"][:5],
        },
        "tier_counters": {k: counters[k] for k in COUNTERS if counters.get(k)},
        "preemptions": counters.get("vllm:num_preemptions_total", counters.get("vllm:num_preemptions")),
    }


def flags_for(variant: str, a: argparse.Namespace, sc: dict, disk_root: Path) -> list[str]:
    bb = sc["measured"]["block_bytes"]
    blocks = sc["big_blocks"] if variant == "reference" else sc["small_blocks"]
    flags = [
        "--device", a.device,
        "--kv-cache-gib", f"{(blocks + 0.5) * bb / 1024**3:.9f}",
        "--block-size", str(a.block_size),
        "--max-model-len", str(sc["max_model_len"]),
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
        "--max-num-seqs", str(2 * (a.chats + 1)),
    ]  # fmt: skip
    if variant != "reference":
        host_gib = (sc["host_blocks"] + 0.5) * bb / 1024**3
        disk = disk_root / variant
        flags += ["--kv-host-gib", f"{host_gib:.9f}", "--kv-disk-dir", str(disk), "--kv-disk-gib", f"{4 * host_gib:.9f}"]
        flags += ["--ttft-budget-ms", "interactive=1000,batch=30000"]
    if variant == "naive":
        flags.append("--kv-naive-sync-disk")
    return flags


def check(variant: str, res: dict, a: argparse.Namespace, blocks: int | None = None) -> Validity:
    """Preconditions of one run's numbers (see EXERCISED); `blocks`: the pool it asked for."""
    v = Validity()
    expected = a.chats * a.chat_turns + 1
    v.require(res["requests"] == expected, f"{res['requests']} requests sent, expected {expected}")
    v.require(not res["errors"], count_errors(res["errors"], "streams"))
    v.require(res["empty_streams"] == 0, f"{res['empty_streams']} streams ended without a token")
    if blocks is not None:
        got = res.get("kv_blocks_total")
        v.require(got == blocks, f"the server's pool has {got} blocks, the scenario sized {blocks}")
    counters = res["tier_counters"]
    for names, why in EXERCISED.get(variant, []):
        v.require(any(counters.get(n, 0) > 0 for n in names), f"{why} ({' / '.join(names)} = 0)")
    return v


def probe(a: argparse.Namespace, log_dir: Path) -> Measured:
    """Measure on a reference-like server (engine-chosen pool): one long prompt alone for
    the prefill rate, then chats + 1 concurrent short streams for the decode step time."""
    log = log_dir / "probe.steps.jsonl"
    flags = ["--device", a.device, "--block-size", str(a.block_size),
             "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--step-log", str(log)]  # fmt: skip

    async def run(url: str) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await stream_completion(session, url, "warmup", token_prompt(5, 64), 8)
            for i in range(2):
                await stream_completion(session, url, "prefill", token_prompt(77 + i, a.long_prompt), 1)
            streams = [token_prompt(300 + i, a.block_size) for i in range(a.chats + 1)]
            await asyncio.gather(*(stream_completion(session, url, "decode", p, 64) for p in streams))

    with serve("tier_scenario_probe", flags, {"TIERGUARD_NUM_THREADS": a.threads}, model=a.model) as url:
        asyncio.run(run(url))
    header, steps = read_step_log(log)
    prefill = [s for s in steps if s["chunks"] and not s["token_rows"] and s["chunk_tokens"] >= a.block_size]
    decode = [s["duration"] for s in steps if s["token_rows"] == a.chats + 1 and not s["chunks"]]
    if not prefill or not decode:
        raise SystemExit("tier_scenario: the probe's step log has no prefill-only or full decode steps")
    pp = sum(s["duration"] for s in prefill) / sum(s["chunk_tokens"] for s in prefill)
    return Measured(statistics.median(decode), pp, int(header["block_bytes"]))


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    disk_root = Path(a.disk_dir or tempfile.mkdtemp(prefix="tier_scenario_"))
    log_dir = Path(a.step_logs) if a.step_logs else disk_root / "steps"
    log_dir.mkdir(parents=True, exist_ok=True)
    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        if None in (a.decode_step_ms, a.prefill_us_per_token, a.block_bytes):
            m = probe(a, log_dir)
        else:
            m = Measured(a.decode_step_ms / 1000, a.prefill_us_per_token / 1e6, a.block_bytes)
        sc = size_scenario(a, m)
        print(f"scenario: {json.dumps(sc)}", file=sys.stderr)
        for r in range(a.repeats):
            for variant in variants:
                flags = flags_for(variant, a, sc, disk_root / f"run{r}")
                log = log_dir / f"{variant}.{r}.steps.jsonl"
                env = {"TIERGUARD_NUM_THREADS": a.threads}
                with serve(f"tier_scenario_{variant}", [*flags, "--step-log", str(log)], env, model=a.model) as url:
                    res = asyncio.run(drive(url, a, sc))
                res["steps"] = step_summary(log)
                blocks = sc["big_blocks"] if variant == "reference" else sc["small_blocks"]
                res.update(check(variant, res, a, blocks).as_dict())
                runs[variant].append(res)
                print(f"{variant} #{r}: p99 ITL {res['p99_itl_ms']} ms, valid {res['valid']}", file=sys.stderr)
    finally:
        if a.disk_dir is None:
            shutil.rmtree(disk_root, ignore_errors=True)
    out: dict = {
        "scenario": {**{k: v for k, v in vars(a).items() if k != "variants"}, **sc},
        "flags": {v: flags_for(v, a, sc, Path("DISK")) for v in variants},
        "variants": {},
    }
    for variant, rs in runs.items():
        out["variants"][variant] = {
            "median_p99_itl_ms": _median([r["p99_itl_ms"] for r in rs]),
            "median_p99_itl_chats_ms": _median([r["p99_itl_chats_ms"] for r in rs]),
            "median_p99_ttft_ms": _median([r["p99_ttft_ms"] for r in rs]),
            "p99_itl_ms_per_run": [r["p99_itl_ms"] for r in rs],
            "runs": rs,
        }
    v = out["variants"]
    run = Validity([f"{name} #{i}: {why}" for name, x in v.items() for i, r in enumerate(x["runs"])
                    for why in r["invalid_reasons"]])  # fmt: skip
    run.require("reference" in v and "contract" in v, "the goal needs both the reference and the contract")
    out.update(run.as_dict())
    ref = v.get("reference", {}).get("median_p99_itl_ms")
    ratio = {k: round(x["median_p99_itl_ms"] / ref, 3) if ref and x["median_p99_itl_ms"] else None for k, x in v.items()}
    out["median_p99_itl_ratio_to_reference"] = ratio
    out["goal_contract_within_1_25x"] = run.goal(None if ratio.get("contract") is None else
                                                 ratio["contract"] <= CONTRACT_GOAL)  # fmt: skip
    if "naive" in v:
        out["goal_naive_at_least_1_5x"] = run.goal(None if ratio.get("naive") is None else ratio["naive"] >= NAIVE_GOAL)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
