"""A prefix saved to NVMe survives a server restart and beats recomputing it.

1. `tierguard serve` with host and disk tiers answers requests with long prefixes; their
   full blocks are written behind to the disk tier; the server is stopped (SIGTERM).
2. A new server on the same disk directory gets the same prefixes with new questions
   appended: the prefix is staged from the disk tier (disk hits counted in /metrics).
3. A server without tiers gets the same requests: the prefix is recomputed.

Same model, flags, warm-up and requests in 2 and 3; the servers run one after another.
Prints JSON: TTFT per request, their medians, the ratio, and the disk-tier counters.
"valid": false (and the ratio null) when a request failed, the first server did not
persist the prefixes, or the restarted server counted no disk hit (nothing came from disk).

    .venv/bin/python bench/prefix_restart.py [--prefix-tokens 1536] [--prefixes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tier_common import ms, scrape, serve, stream_completion, token_prompt  # noqa: E402
from validity import Validity, count_errors  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-tokens", type=int, default=1536)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--prefixes", type=int, default=3)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--threads", default="1", help="TIERGUARD_NUM_THREADS for the servers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--disk-dir", default=None, help="NVMe tier dir (default: a temp dir)")
    p.add_argument(
        "--warm-page-cache",
        dest="cold",
        action="store_false",
        help="keep the block files in the page cache across the restart (default: evict them)",
    )
    return p.parse_args(argv)


async def _ask(url: str, prompts: list[list[int]], a: argparse.Namespace, wait_persisted: int = 0) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_completion(session, url, "warmup", token_prompt(5, 64), 4)
        streams = [
            await stream_completion(session, url, f"p{i}", p, a.output_tokens) for i, p in enumerate(prompts)
        ]
        counters = await scrape(session, url)
        for _ in range(600):  # write-behind: wait until the prefixes are on disk
            if counters.get("kv_persisted_blocks", 0) >= wait_persisted:
                break
            await asyncio.sleep(0.05)
            counters = await scrape(session, url)
    return {
        "ttft_ms": [ms(s.ttft_s) for s in streams],
        "errors": [s.error or f"{s.name}: no token" for s in streams if s.error or not s.events],
        "counters": counters,
    }


def drop_page_cache(root: Path) -> int:
    """Evict the tier's files from the page cache (per file, POSIX_FADV_DONTNEED), so the
    restarted server reads the device, not RAM. Touches no other file. Returns the count."""
    n = 0
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    disk = Path(a.disk_dir or tempfile.mkdtemp(prefix="prefix_restart_"))
    env = {"TIERGUARD_NUM_THREADS": a.threads}
    base = [
        "--device",
        a.device,
        "--max-model-len",
        "2048",
        "--kv-cache-gib",
        "0.05",
        "--max-num-batched-tokens",
        "512",
    ]
    tiers = ["--kv-host-gib", "0.05", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.5"]
    prefixes = [token_prompt(300 + i, a.prefix_tokens) for i in range(a.prefixes)]
    first = [p + token_prompt(400 + i, a.question_tokens) for i, p in enumerate(prefixes)]
    again = [p + token_prompt(500 + i, a.question_tokens) for i, p in enumerate(prefixes)]
    blocks = a.prefixes * (a.prefix_tokens // 16)
    try:
        with serve("prefix_restart_save", base + tiers, env) as url:
            saved = asyncio.run(_ask(url, first, a, wait_persisted=blocks))
        dropped = drop_page_cache(disk) if a.cold else 0
        with serve("prefix_restart_disk", base + tiers, env) as url:
            from_disk = asyncio.run(_ask(url, again, a))
        with serve("prefix_restart_recompute", base, env) as url:
            recompute = asyncio.run(_ask(url, again, a))
    finally:
        if a.disk_dir is None:
            shutil.rmtree(disk, ignore_errors=True)
    keys = ("kv_disk_hits", "kv_blocks_loaded_from_disk", "kv_persisted_blocks", "kv_tier_recomputes")
    errors = saved["errors"] + from_disk["errors"] + recompute["errors"]
    v = Validity()
    v.require(not errors, count_errors(errors))
    persisted = saved["counters"].get("kv_persisted_blocks") or 0
    v.require(persisted >= blocks, f"the first server persisted {persisted:g} of {blocks} prefix blocks")
    hits = from_disk["counters"].get("kv_disk_hits") or 0
    v.require(hits > 0, "no disk hit counted after the restart: the prefixes were not loaded from disk")
    disk_med = _median(from_disk["ttft_ms"])
    rec_med = _median(recompute["ttft_ms"])
    out = {
        "prefix_tokens": a.prefix_tokens,
        "prefixes": a.prefixes,
        "page_cache_evicted_files": dropped,
        "saved_first_run": {"ttft_ms": saved["ttft_ms"], "persisted_blocks": saved["counters"].get(keys[2])},
        "after_restart_from_disk": {
            "ttft_ms": from_disk["ttft_ms"],
            "median_ttft_ms": disk_med,
            "counters": {k: from_disk["counters"].get(k) for k in keys},
        },
        "recompute_no_tiers": {"ttft_ms": recompute["ttft_ms"], "median_ttft_ms": rec_med},
        "ttft_ratio_disk_to_recompute": round(disk_med / rec_med, 3) if v.valid and disk_med and rec_med else None,
        "disk_hit_counted": hits > 0,
        "errors": errors,
        **v.as_dict(),
    }
    print(json.dumps(out, indent=2))
    return 0


def _median(values: list[float | None]) -> float | None:
    got = [x for x in values if x is not None]
    return statistics.median(got) if got else None


if __name__ == "__main__":
    raise SystemExit(main())
