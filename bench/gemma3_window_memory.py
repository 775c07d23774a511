"""Sliding-window KV that the pool actually frees: Gemma 3's block accounting, measured.

The blocks a sequence holds depend on the model's KV geometry only (layer kinds, window,
KV heads x head_dim, block size, chunk), not on its weights. So the runs use a random
model with Gemma 3 270M's geometry (18 layers, one full-attention layer in six, window
512, 1 KV head of 256) and a small hidden size, and compare with `plan` reading the real
Gemma 3 270M config (`--model gemma3`, when its package is installed) or the same
geometry:

- one 32k-token sequence: blocks each layer group holds (last step, and the peak over
  the run) against plan's pages per layer;
- 8k-token sequences in a fixed KV pool: how many run at once with no preemption, Gemma
  3 against the same geometry with every layer full attention, against plan's
  max_concurrency for that pool. N predicted sequences must run without preemption and
  N + 1 must not.

Prints one JSON document with "valid". Usage:
    nice .venv/bin/python bench/gemma3_window_memory.py [--long 32768] [--context 8192] [--pool-gib 0.4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.validity import Validity  # noqa: E402
from tierguard.common.errors import TierguardError  # noqa: E402
from tierguard.common.units import GIB  # noqa: E402
from tierguard.engine.api import SamplingParams  # noqa: E402
from tierguard.engine.factory import build_engine  # noqa: E402
from tierguard.model.registry import resolve_model  # noqa: E402
from tierguard.model.tiny import create_tiny  # noqa: E402
from tierguard.plan.catalogue import load_model  # noqa: E402
from tierguard.plan.dtypes import kv_format  # noqa: E402
from tierguard.plan.kv import KVModel, KVSettings  # noqa: E402

BS, CHUNK, OUT = 16, 512, 8
GEOMETRY = dict(layers=18, hidden=64, heads=1, kv_heads=1, head_dim=256, vocab=512, seed=0, arch="gemma3")


def _model(root: Path, name: str, pattern: int, max_len: int) -> Path:
    return create_tiny(
        root / name, max_position_embeddings=max_len, sliding_window=512, sliding_pattern=pattern, **GEOMETRY
    )


def _plan(model: str, max_len: int) -> KVModel:
    spec = load_model(model, [])
    settings = KVSettings(
        fmt=kv_format("float32", "float32"), max_model_len=max_len, block_size=BS, max_num_batched_tokens=CHUNK
    )
    return KVModel(spec, settings)


def _engine(model_dir: Path, pool_gib: float, max_len: int, seqs: int):
    return build_engine(
        model_dir, dtype="float32", device="cpu", kv_cache_gib=pool_gib, block_size=BS, max_num_seqs=seqs,
        max_num_batched_tokens=max(CHUNK, seqs), max_model_len=max_len, target_itl_ms=0.0,
        enable_prefix_caching=False,
    )  # fmt: skip


def _prompt(i: int, n: int) -> list[int]:
    return [5 + (i * 7919 + j * 104729) % 500 for j in range(n)]


def one_long_sequence(model_dir: Path, plan: KVModel, length: int) -> dict:
    engine = _engine(model_dir, 1.0, length, 1)
    seen: list[list[int]] = []

    def watch(_stats) -> None:
        for seq in engine.scheduler.running:
            seen.append(engine.block_manager.blocks_per_group(seq))

    engine.add_step_listener(watch)
    t0 = time.perf_counter()
    engine.generate([_prompt(0, length - OUT)], SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True))
    groups = engine.groups.groups
    last, peak = seen[-1], [max(s[g] for s in seen) for g in range(len(groups))]
    kinds = ["full" if g.window is None else "sliding" for g in groups]
    return {
        "tokens": length,
        "seconds": round(time.perf_counter() - t0, 1),
        "groups": [
            {
                "kind": kind,
                "layers": list(g.layers),
                "blocks_last_step": last[i],
                "tokens_last_step": last[i] * BS,
                "blocks_peak": peak[i],
                "plan_pages_per_layer": plan.pages(kind, length),
            }
            for i, (g, kind) in enumerate(zip(groups, kinds, strict=True))
        ],
        "pool_blocks_used_last_step": sum(last),
        "plan_sequence_bytes": plan.sequence_bytes(length),
        "engine_sequence_bytes": engine.groups.sequence_blocks(length, CHUNK, BS) * _block_bytes(engine),
    }


def _block_bytes(engine) -> int:
    return engine.runner.device_pool.tensors[0][0].nbytes


def fit(model_dir: Path, plan: KVModel, context: int, pool_gib: float) -> dict:
    predicted = int(pool_gib * GIB) // plan.sequence_bytes(context)
    runs = {}
    for n in (predicted, predicted + 1):
        if n == 0:
            continue
        engine = _engine(model_dir, pool_gib, context, n)
        running: list[int] = []
        engine.add_step_listener(lambda _s, e=engine, r=running: r.append(len(e.scheduler.running)))
        params = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        engine.generate([_prompt(i, context - OUT) for i in range(n)], params)
        runs[str(n)] = {
            "preemptions": engine.scheduler.num_preemptions,
            "max_running": max(running),
            "seconds": round(time.perf_counter() - t0, 1),
            "pool_blocks": engine.config.num_blocks,
            "blocks_per_sequence": engine.groups.sequence_blocks(context, CHUNK, BS),
        }
    engine_fit = runs[str(predicted + 1)]["pool_blocks"] // runs[str(predicted + 1)]["blocks_per_sequence"]
    return {"plan_max_concurrency": predicted, "engine_fit": engine_fit, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool-gib", type=float, default=0.4)
    args = ap.parse_args()
    v = Validity()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gemma = _model(root, "gemma3-geometry", 6, args.long)
        flat = _model(root, "no-window", 1, args.long)
        try:
            real = str(resolve_model("gemma3"))
        except TierguardError:  # the package is optional here
            real = None
        plan = _plan(real or str(gemma), args.long)
        out: dict = {"plan_model": "gemma3 (real config)" if real else "gemma3 geometry", "block_size": BS,
                     "chunk": CHUNK}  # fmt: skip
        out["long_sequence"] = long = one_long_sequence(gemma, plan, args.long)
        for g in long["groups"]:
            v.require(g["blocks_peak"] <= g["plan_pages_per_layer"], f"group {g['layers']} held more than plan says")
            if g["kind"] == "sliding":
                v.require(
                    g["tokens_last_step"] <= 512 + 2 * BS, f"sliding group {g['layers']} kept {g['tokens_last_step']}"
                )
        v.require(long["plan_sequence_bytes"] == long["engine_sequence_bytes"], "plan and engine bytes differ")
        out["fit"] = {
            "context": args.context,
            "pool_gib": args.pool_gib,
            "gemma3": fit(gemma, _plan(real or str(gemma), args.context), args.context, args.pool_gib),
            "no_window": fit(flat, _plan(str(flat), args.context), args.context, args.pool_gib),
        }
        for name in ("gemma3", "no_window"):
            f = out["fit"][name]
            n = f["plan_max_concurrency"]
            v.require(f["engine_fit"] == n, f"{name}: engine fits {f['engine_fit']}, plan says {n}")
            if str(n) in f["runs"]:
                v.require(f["runs"][str(n)]["preemptions"] == 0, f"{name}: {n} sequences were preempted")
                v.require(f["runs"][str(n)]["max_running"] == n, f"{name}: {n} sequences did not run at once")
            v.require(
                f["runs"][str(n + 1)]["preemptions"] > 0 or f["runs"][str(n + 1)]["max_running"] <= n,
                f"{name}: {n + 1} sequences ran at once without preemption",
            )
        ratio = out["fit"]["gemma3"]["plan_max_concurrency"] / max(1, out["fit"]["no_window"]["plan_max_concurrency"])
        out["fit"]["gemma3_vs_no_window"] = round(ratio, 2)
        out["window_tokens_per_sliding_layer"] = [
            g["tokens_last_step"] for g in long["groups"] if g["kind"] == "sliding"
        ]
    out.update(v.as_dict())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
