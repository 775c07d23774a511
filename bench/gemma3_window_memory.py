"""Sliding-window KV that the pool actually frees: Gemma 3's block accounting, measured.

The blocks a sequence holds depend on the KV geometry only (layer kinds, window, KV
heads x head_dim, block size, step size), not on what the model computes. So this runs
the engine's own Scheduler, BlockManager and BlockPool for Gemma 3 270M's config (the
real one from `--model gemma3` when its package is installed, else the same geometry),
stepping them exactly as LLMEngine.step does, minus the forward pass (each scheduled
chunk is marked computed; a sampling step appends a token). The end-to-end runs with a
model live in tests/engine/test_gemma3_window.py.

- one 32k-token sequence: blocks each layer group holds at its last step and at its
  peak, against plan's pages per layer; plan's and the engine's KV bytes per sequence;
- 8k-token sequences in a fixed pool: how many run at once, Gemma 3 against the same
  geometry with every layer full attention, against plan's max_concurrency for that
  pool. The N that plan and the engine's accounting give (each sequence charged its
  peak: full layers at 8k, sliding layers their window plus one prefill chunk) must all
  run at once with no preemption. N + 1 is reported: without a window it preempts; with
  one it may not, since only the sequence prefilling holds its extra chunk.

Prints one JSON document with "valid". Usage:
    .venv/bin/python bench/gemma3_window_memory.py [--long 32768] [--context 8192] [--pool-gib 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.validity import Validity  # noqa: E402
from tierguard.common.errors import TierguardError  # noqa: E402
from tierguard.common.units import GIB  # noqa: E402
from tierguard.engine.api import SamplingParams  # noqa: E402
from tierguard.engine.block_manager import BlockManager  # noqa: E402
from tierguard.engine.block_pool import BlockPool  # noqa: E402
from tierguard.engine.config import EngineConfig  # noqa: E402
from tierguard.engine.model_runner import kv_block_bytes  # noqa: E402
from tierguard.engine.scheduler import Scheduler  # noqa: E402
from tierguard.engine.sequence import Sequence  # noqa: E402
from tierguard.model.config import ModelConfig  # noqa: E402
from tierguard.model.gemma3 import kv_groups  # noqa: E402
from tierguard.model.registry import resolve_model  # noqa: E402
from tierguard.model.tiny import create_tiny  # noqa: E402
from tierguard.plan.catalogue import load_model  # noqa: E402
from tierguard.plan.dtypes import kv_format  # noqa: E402
from tierguard.plan.kv import KVModel, KVSettings  # noqa: E402

BS, CHUNK, OUT = 16, 512, 8
# In the fit runs each sequence decodes this long, so the first admitted still runs when
# the last one's prefill ends (prefills run one after another, a chunk per step).
FIT_OUT = 256
GEOMETRY = dict(layers=18, hidden=64, heads=4, kv_heads=1, head_dim=256, vocab=512, seed=0, arch="gemma3")


class PoolRun:
    """The engine's block accounting for one config and pool, without a model."""

    def __init__(self, model_dir: str, pool_bytes: int, max_len: int, seqs: int) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        self.groups = kv_groups(cfg)
        self.block_bytes = kv_block_bytes(cfg, BS, torch.float32)
        config = EngineConfig(
            num_blocks=pool_bytes // self.block_bytes, block_size=BS, max_num_seqs=seqs,
            max_num_batched_tokens=max(CHUNK, seqs), max_model_len=max_len, enable_prefix_caching=False,
        )  # fmt: skip
        self.pool = BlockPool(config.num_blocks)
        self.bm = BlockManager(self.pool, BS, 0, False, groups=self.groups, max_chunk=config.max_num_batched_tokens)
        self.scheduler = Scheduler(config, self.bm)
        self.config = config

    def run(self, prompts: list[int], out_len: int = OUT, watch=None) -> int:
        """Run sequences of these prompt lengths to `out_len` tokens each; returns the most running at once."""
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        for i, n in enumerate(prompts):
            self.scheduler.add(Sequence(f"s{i}", [1] * n, params, 0.0))
        most = 0
        while self.scheduler.has_work():
            out = self.scheduler.schedule()
            for item in out.scheduled:  # what LLMEngine.step does after the forward pass
                seq = item.seq
                seq.num_computed_tokens += item.num_tokens
                self.bm.register_computed(seq)
                if item.samples:
                    seq.append_token(1)
                    if seq.num_output_tokens >= out_len:
                        self.scheduler.remove(seq)
            self.bm.check_integrity()
            most = max(most, len(self.scheduler.running))
            if watch is not None:
                watch(self)
        return most


def _plan(model: str, max_len: int) -> KVModel:
    settings = KVSettings(
        fmt=kv_format("float32", "float32"), max_model_len=max_len, block_size=BS, max_num_batched_tokens=CHUNK
    )
    return KVModel(load_model(model, []), settings)


def one_long_sequence(model: str, length: int) -> dict:
    plan = _plan(model, length)
    run = PoolRun(model, 4 * GIB, length, 1)
    seen: list[list[int]] = []
    run.run([length - OUT], watch=lambda r: seen.extend(r.bm.blocks_per_group(s) for s in r.scheduler.running))
    last, peak = seen[-1], [max(s[g] for s in seen) for g in range(run.groups.num_groups)]
    out = {"tokens": length, "groups": []}
    for i, g in enumerate(run.groups.groups):
        kind = "full" if g.window is None else "sliding"
        out["groups"].append({
            "kind": kind, "layers": list(g.layers), "blocks_last_step": last[i], "tokens_last_step": last[i] * BS,
            "blocks_peak": peak[i], "plan_pages_per_layer": plan.pages(kind, length),
        })  # fmt: skip
    out["pool_blocks_used_last_step"] = sum(last)
    out["no_window_blocks"] = run.groups.num_groups * -(-length // BS)
    out["plan_sequence_bytes"] = plan.sequence_bytes(length)
    out["engine_sequence_bytes"] = run.groups.sequence_blocks(length, CHUNK, BS) * run.block_bytes
    return out


def fit(model: str, context: int, pool_gib: float) -> dict:
    predicted = int(int(pool_gib * GIB) // _plan(model, context).sequence_bytes(context))
    runs = {}
    for n in (predicted, predicted + 1):
        run = PoolRun(model, int(pool_gib * GIB), context, n)
        t0 = time.perf_counter()
        most = run.run([context - FIT_OUT] * n, FIT_OUT)
        runs[str(n)] = {
            "preemptions": run.scheduler.num_preemptions, "max_running": most,
            "pool_blocks": run.config.num_blocks, "blocks_per_sequence": run.groups.sequence_blocks(context, CHUNK, BS),
            "seconds": round(time.perf_counter() - t0, 2),
        }  # fmt: skip
    last = runs[str(predicted + 1)]
    return {"plan_max_concurrency": predicted, "engine_fit": last["pool_blocks"] // last["blocks_per_sequence"], "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool-gib", type=float, default=1.0)
    args = ap.parse_args()
    v = Validity()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gemma, source = str(resolve_model("gemma3")), "Gemma 3 270M config (--model gemma3)"
        except TierguardError:  # the package is optional here
            gemma = str(create_tiny(Path(tmp) / "g", max_position_embeddings=args.long, sliding_window=512,
                                    sliding_pattern=6, **GEOMETRY))  # fmt: skip
            source = "Gemma 3 270M geometry (random weights)"
        flat = str(create_tiny(Path(tmp) / "flat", max_position_embeddings=args.long, sliding_window=512,
                               sliding_pattern=1, **GEOMETRY))  # fmt: skip
        out: dict = {"model": source, "block_size": BS, "chunk": CHUNK, "kv_dtype": "float32"}
        out["long_sequence"] = long = one_long_sequence(gemma, args.long)
        for g in long["groups"]:
            v.require(g["blocks_peak"] <= g["plan_pages_per_layer"], f"group {g['layers']} held more than plan says")
            if g["kind"] == "sliding":
                v.require(g["tokens_last_step"] <= 512 + BS, f"sliding group {g['layers']} kept {g['tokens_last_step']}")
        v.require(long["plan_sequence_bytes"] == long["engine_sequence_bytes"], "plan and engine bytes differ")
        out["fit"] = {"context": args.context, "pool_gib": args.pool_gib,
                      "gemma3": fit(gemma, args.context, args.pool_gib),
                      "no_window": fit(flat, args.context, args.pool_gib)}  # fmt: skip
    for name in ("gemma3", "no_window"):
        f = out["fit"][name]
        n = f["plan_max_concurrency"]
        v.require(f["engine_fit"] == n, f"{name}: engine fits {f['engine_fit']}, plan says {n}")
        v.require(f["runs"][str(n)]["preemptions"] == 0 and f["runs"][str(n)]["max_running"] == n,
                  f"{name}: {n} sequences did not run at once without preemption")  # fmt: skip
    v.require(out["fit"]["no_window"]["runs"][str(out["fit"]["no_window"]["plan_max_concurrency"] + 1)]["preemptions"] > 0,
              "no_window: one sequence more than plan's count ran without preemption")  # fmt: skip
    out["fit"]["gemma3_vs_no_window"] = round(
        out["fit"]["gemma3"]["plan_max_concurrency"] / max(1, out["fit"]["no_window"]["plan_max_concurrency"]), 2
    )
    out.update(v.as_dict())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
