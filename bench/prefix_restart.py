"""A prefix saved to NVMe survives a server restart and beats recomputing it.

1. `tierguard serve` with host and disk tiers answers requests with long prefixes; their
   full blocks are written behind to the disk tier; the server is stopped (SIGTERM).
2. A new server on the same disk directory gets the same prefixes with new questions
   appended: the prefix is staged from the disk tier (disk hits counted in /metrics).
3. A server without tiers gets the same requests: the prefix is recomputed.

With `--encrypt` (cold KV at rest, AES-256-GCM), in the same run and after 2: steps 1
and 2 again with `--kv-encrypt-key-file A` on a fresh directory (what encryption costs
in prefix-load TTFT, against the unencrypted load of this run), then a server with key B
(each block a counted undecodable miss: recomputed, same output) and one with key A again
(disk hits: the key-B server destroyed nothing).

Same model, flags, warm-up and requests in every server; they run one after another.
Prints JSON: TTFT per request, their medians, the ratios, and the disk-tier counters.
"valid": false (and the ratios null) when a request failed, a first server did not
persist the prefixes, a restarted server counted no disk hit, an output differs from
the recomputed one, or (with --encrypt) key B was not a counted miss.

    .venv/bin/python bench/prefix_restart.py [--prefix-tokens 1536] [--prefixes 3] [--encrypt]
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
        "--encrypt",
        action="store_true",
        help="also measure the encrypted disk tier, and a restart with a wrong key then the right one",
    )
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
        "texts": [s.text for s in streams],
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
    work = Path(tempfile.mkdtemp(prefix="prefix_restart_"))
    disk = Path(a.disk_dir) if a.disk_dir else work / "kv"
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
    prefixes = [token_prompt(300 + i, a.prefix_tokens) for i in range(a.prefixes)]
    first = [p + token_prompt(400 + i, a.question_tokens) for i, p in enumerate(prefixes)]
    again = [p + token_prompt(500 + i, a.question_tokens) for i, p in enumerate(prefixes)]
    blocks = a.prefixes * (a.prefix_tokens // 16)
    runs: dict[str, dict] = {}

    def tiers(root: Path, key: Path | None = None) -> list[str]:
        flags = ["--kv-host-gib", "0.05", "--kv-disk-dir", str(root), "--kv-disk-gib", "0.5"]
        return base + flags + (["--kv-encrypt-key-file", str(key)] if key else [])

    def restart(name: str, flags: list[str], root: Path) -> None:
        dropped = drop_page_cache(root) if a.cold else 0
        with serve(f"prefix_restart_{name}", flags, env) as url:
            runs[name] = asyncio.run(_ask(url, again, a))
        runs[name]["page_cache_evicted_files"] = dropped

    try:
        with serve("prefix_restart_save", tiers(disk), env) as url:
            runs["save"] = asyncio.run(_ask(url, first, a, wait_persisted=blocks))
        restart("disk", tiers(disk), disk)
        if a.encrypt:
            enc, key_a, key_b = work / "kv-encrypted", _key(work, "A"), _key(work, "B")
            with serve("prefix_restart_save_encrypted", tiers(enc, key_a), env) as url:
                runs["save_encrypted"] = asyncio.run(_ask(url, first, a, wait_persisted=blocks))
            restart("disk_encrypted", tiers(enc, key_a), enc)
            restart("wrong_key", tiers(enc, key_b), enc)
            restart("key_a_again", tiers(enc, key_a), enc)
        with serve("prefix_restart_recompute", base, env) as url:
            runs["recompute"] = asyncio.run(_ask(url, again, a))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report(a, runs, blocks), indent=2))
    return 0


KEYS = ("kv_disk_hits", "kv_blocks_loaded_from_disk", "kv_persisted_blocks", "kv_tier_recomputes",
        "kv_disk_undecodable", "kv_stage_failures")  # fmt: skip


def report(a: argparse.Namespace, runs: dict[str, dict], blocks: int) -> dict:
    """The JSON: medians, ratios and counters per server, and whether the run is valid."""
    v = Validity()
    errors = [e for r in runs.values() for e in r["errors"]]
    v.require(not errors, count_errors(errors))
    truth = runs["recompute"]["texts"]

    def counter(name: str, key: str) -> float:
        return runs[name]["counters"].get(key) or 0

    for save in ("save", "save_encrypted"):
        if save in runs:
            got = counter(save, "kv_persisted_blocks")
            v.require(got >= blocks, f"the {save} server persisted {got:g} of {blocks} prefix blocks")
    for name in ("disk", "disk_encrypted", "key_a_again"):
        if name in runs:
            v.require(counter(name, "kv_disk_hits") > 0, f"{name}: no disk hit counted after the restart")
    for name, r in runs.items():
        if name not in ("save", "save_encrypted", "recompute"):
            v.require(r["texts"] == truth, f"{name}: output differs from the recomputed one")
    if "wrong_key" in runs:
        v.require(counter("wrong_key", "kv_disk_undecodable") > 0, "key B: no undecodable block counted")
        v.require(counter("wrong_key", "kv_disk_hits") == 0, "key B: a disk hit with the wrong key")
        v.require(counter("key_a_again", "kv_disk_undecodable") == 0, "key A again: undecodable blocks")

    def phase(name: str) -> dict:
        r = runs[name]
        return {"ttft_ms": r["ttft_ms"], "median_ttft_ms": _median(r["ttft_ms"]),
                "page_cache_evicted_files": r.get("page_cache_evicted_files", 0),
                "counters": {k: r["counters"].get(k) for k in KEYS}}  # fmt: skip

    def ratio(num: str, den: str) -> float | None:
        n, d = _median(runs[num]["ttft_ms"]), _median(runs[den]["ttft_ms"])
        return round(n / d, 3) if v.valid and n and d else None

    out = {
        "prefix_tokens": a.prefix_tokens,
        "prefixes": a.prefixes,
        "saved_first_run": {"ttft_ms": runs["save"]["ttft_ms"], "persisted_blocks": counter("save", KEYS[2])},
        "after_restart_from_disk": phase("disk"),
        "recompute_no_tiers": {
            "ttft_ms": runs["recompute"]["ttft_ms"],
            "median_ttft_ms": _median(runs["recompute"]["ttft_ms"]),
        },  # fmt: skip
        "ttft_ratio_disk_to_recompute": ratio("disk", "recompute"),
        "disk_hit_counted": counter("disk", "kv_disk_hits") > 0,
    }
    if "disk_encrypted" in runs:
        out["encrypted"] = {
            "after_restart_from_disk": phase("disk_encrypted"),
            "ttft_ratio_encrypted_to_plain_disk": ratio("disk_encrypted", "disk"),
            "ttft_ratio_encrypted_to_recompute": ratio("disk_encrypted", "recompute"),
            "restart_with_key_b": {**phase("wrong_key"), "output_equals_recompute": runs["wrong_key"]["texts"] == truth},
            "restart_with_key_a_again": {**phase("key_a_again"),
                                         "output_equals_recompute": runs["key_a_again"]["texts"] == truth},
        }  # fmt: skip
    out["errors"] = errors
    out.update(v.as_dict())
    return out


def _key(work: Path, name: str) -> Path:
    path = work / f"key-{name}"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def _median(values: list[float | None]) -> float | None:
    got = [x for x in values if x is not None]
    return statistics.median(got) if got else None


if __name__ == "__main__":
    raise SystemExit(main())
