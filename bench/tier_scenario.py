"""The article's scenario, scaled to this machine: four chats and one long request.

Four chats at a short context run several turns each (every turn re-sends the history
plus a few new tokens); shortly after they start, one long request with a long answer
arrives. The same request profile (same token ids, output lengths, greedy, EOS ignored,
same arrival offsets, one warm-up request) is run against three real `tierguard serve`
subprocesses, one after the other:

  reference  device pool large enough for everything, no tiers
  contract   device pool too small to hold them all; host-RAM and NVMe tiers on
  naive      the same small pool and tiers with --kv-naive-sync-disk (running sequences
             spill to disk and are read back synchronously inside the step)

Prints one JSON document: p50/p99 TTFT and ITL per variant (all requests, and the chats
alone), the ratios to the reference, and the tier counters scraped from /metrics.
Goal: contract p99 ITL within 1.25x of the reference; naive several times worse.
A run is "valid": false (and the goal null) when any stream failed or came back empty,
or a tiered variant did not use its tiers (EXERCISED: counters that must be non-zero).

    .venv/bin/python bench/tier_scenario.py [--small-blocks 160] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tier_common import ms, pct, scrape, serve, stream_completion, token_prompt  # noqa: E402
from validity import Validity, count_errors  # noqa: E402

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-context", type=int, default=256, help="first-turn prompt tokens of a chat")
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-user-tokens", type=int, default=32, help="tokens added per turn")
    p.add_argument("--chat-output", type=int, default=48)
    p.add_argument("--long-prompt", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=384)
    p.add_argument("--long-delay", type=float, default=0.5, help="seconds after the chats start")
    p.add_argument(
        "--long-class",
        default="batch",
        choices=["batch", "interactive"],
        help="request class of the long request (document analysis: batch by default)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-bytes", type=int, default=32768, help="KV bytes per block of the tiny model")
    p.add_argument("--small-blocks", type=int, default=160, help="device pool of the tiered variants")
    p.add_argument("--big-blocks", type=int, default=512, help="device pool of the reference")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--threads", default="1", help="TIERGUARD_NUM_THREADS for the servers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", default="reference,contract,naive")
    p.add_argument("--disk-dir", default=None, help="NVMe tier parent dir (default: a temp dir)")
    return p.parse_args(argv)


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


async def drive(url: str, a: argparse.Namespace) -> dict:
    chats, long_prompt = profile(a)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_completion(session, url, "warmup", token_prompt(5, 64), 8)

        async def chat(turns: list[list[int]], c: int) -> list:
            return [await stream_completion(session, url, f"chat{c}", p, a.chat_output) for p in turns]

        async def long() -> list:
            await asyncio.sleep(a.long_delay)
            return [
                await stream_completion(
                    session, url, "long", long_prompt, a.long_output, request_class=a.long_class
                )
            ]

        results = await asyncio.gather(*(chat(t, c) for c, t in enumerate(chats)), long())
        streams = [s for group in results for s in group]
        counters = await scrape(session, url)
    itl = [g for s in streams for g in s.itls_s]
    chat_itl = [g for s in streams if s.name.startswith("chat") for g in s.itls_s]
    ttft = [s.ttft_s for s in streams if s.ttft_s is not None]
    chat_ttft = [s.ttft_s for s in streams if s.name.startswith("chat") and s.ttft_s is not None]
    long_s = next(s for s in streams if s.name == "long")
    return {
        "requests": len(streams),
        "errors": [s.error for s in streams if s.error],
        "empty_streams": sum(1 for s in streams if not s.error and not s.events),
        "output_events": sum(len(s.events) for s in streams),
        "p50_ttft_ms": ms(pct(ttft, 50)),
        "p99_ttft_ms": ms(pct(ttft, 99)),
        "p99_ttft_chats_ms": ms(pct(chat_ttft, 99)),
        "long_ttft_ms": ms(long_s.ttft_s),
        "p50_itl_ms": ms(pct(itl, 50)),
        "p99_itl_ms": ms(pct(itl, 99)),
        "max_itl_ms": ms(max(itl) if itl else None),
        "p99_itl_chats_ms": ms(pct(chat_itl, 99)),
        "p99_itl_long_ms": ms(pct(long_s.itls_s, 99)),
        "tier_counters": {k: counters[k] for k in COUNTERS if k in counters},
        "preemptions": counters.get("vllm:num_preemptions_total", counters.get("vllm:num_preemptions")),
    }


def flags_for(variant: str, a: argparse.Namespace, disk_root: Path) -> list[str]:
    gib = (a.big_blocks if variant == "reference" else a.small_blocks) * a.block_bytes / 1024**3
    flags = [
        "--device", a.device,
        "--kv-cache-gib", f"{gib:.9f}",
        "--block-size", str(a.block_size),
        "--max-model-len", str(a.max_model_len),
        "--max-num-batched-tokens", str(a.max_num_batched_tokens),
        "--max-num-seqs", "8",
    ]  # fmt: skip
    if variant != "reference":
        disk = disk_root / variant
        flags += ["--kv-host-gib", "0.05", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.5"]
        flags += ["--ttft-budget-ms", "interactive=1000,batch=30000"]
    if variant == "naive":
        flags.append("--kv-naive-sync-disk")
    return flags


def check(variant: str, res: dict, a: argparse.Namespace) -> Validity:
    """Preconditions of one variant's numbers (see EXERCISED)."""
    v = Validity()
    expected = a.chats * a.chat_turns + 1
    v.require(res["requests"] == expected, f"{res['requests']} requests sent, expected {expected}")
    v.require(not res["errors"], count_errors(res["errors"], "streams"))
    v.require(res["empty_streams"] == 0, f"{res['empty_streams']} streams ended without a token")
    counters = res["tier_counters"]
    for names, why in EXERCISED.get(variant, []):
        v.require(any(counters.get(n, 0) > 0 for n in names), f"{why} ({' / '.join(names)} = 0)")
    return v


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    disk_root = Path(a.disk_dir or tempfile.mkdtemp(prefix="tier_scenario_"))
    out: dict = {"scenario": {k: v for k, v in vars(a).items() if k != "variants"}, "variants": {}}
    try:
        for variant in a.variants.split(","):
            flags = flags_for(variant, a, disk_root)
            with serve(f"tier_scenario_{variant}", flags, {"TIERGUARD_NUM_THREADS": a.threads}) as url:
                res = asyncio.run(drive(url, a))
            res["flags"] = flags
            res.update(check(variant, res, a).as_dict())
            out["variants"][variant] = res
            print(
                f"{variant}: p99 ITL {res['p99_itl_ms']} ms, p99 TTFT {res['p99_ttft_ms']} ms",
                file=sys.stderr,
            )
    finally:
        if a.disk_dir is None:
            shutil.rmtree(disk_root, ignore_errors=True)
    v = out["variants"]
    run = Validity([f"{name}: {why}" for name, r in v.items() for why in r["invalid_reasons"]])
    run.require("reference" in v and "contract" in v, "the goal needs both the reference and the contract")
    out.update(run.as_dict())
    ref = v.get("reference", {}).get("p99_itl_ms")
    if ref:
        out["p99_itl_ratio_to_reference"] = {
            k: round(r["p99_itl_ms"] / ref, 3) if r["p99_itl_ms"] is not None else None for k, r in v.items()
        }
    met = ref and v.get("contract", {}).get("p99_itl_ms") is not None and v["contract"]["p99_itl_ms"] <= 1.25 * ref
    out["goal_contract_within_1_25x"] = run.goal(bool(met))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
