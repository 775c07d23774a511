"""KV quantization in the device pool: memory saved and what it costs in quality (R7).

Prints one JSON document:
- memory: KV bytes per token (scales included) and blocks per GiB for auto / int8 / fp8,
  for the tiny model (fp32) and for an 8B-class GQA shape in fp16 (R2's example);
- attention_error: max / mean |attention output - fp32 reference| at long contexts on
  random Q/K/V whose keys have outlier channels (the engine path's numerics match
  tierguard.kv.quant.attention_error; tests/engine/test_kv_quant_pool.py checks that);
- model_attention_error: the same, per layer, for the tiny model's own K/V: one decode
  step after a long prompt, engine pool (int8/fp8) against the fp32 pool;
- agreement: greedy-token agreement over a long generation (free-running and
  teacher-forced) and the teacher-forced logit error, per model, same model weights;
- decode_speed: median decode step (TPOT) of the tiny model per mode, same workload
  (quantize-on-write and dequantize-on-read are not free on a CPU).

The run is `"valid"` only if it measured what it reports: the int8 / fp8 pools hold fewer
bytes per token than auto, a quantized pool's attention differs from fp32 at all (zero
error means the quantization did not happen), every error is finite, and the agreement
rows cover both quantized modes with values in range.

Usage: .venv/bin/python bench/kv_quant_quality.py [--steps 512] [--prompt 1024] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

from tierguard.common.units import GIB
from tierguard.engine.api import SamplingParams, StepStats
from tierguard.engine.factory import build_engine
from tierguard.engine.kv_quality import agreement, attention_output_error
from tierguard.engine.model_runner import kv_layout
from tierguard.kv.quant import attention_error, random_qkv
from tierguard.model.config import ModelConfig
from tierguard.model.loader import load_model
from tierguard.model.tiny import create_tiny, ensure_tiny_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validity import Validity  # noqa: E402

MODES = ("auto", "int8", "fp8")


def memory(cfg: ModelConfig, dtype: torch.dtype, block_size: int = 16) -> dict:
    out = {}
    for mode in MODES:
        layout = kv_layout(cfg, block_size, dtype, mode)
        per_block = layout.data_bytes_per_block + layout.scale_bytes_per_block
        out[mode] = {"bytes_per_token": layout.bytes_per_token(), "blocks_per_gib": GIB // per_block}
    for mode in MODES[1:]:
        out[mode]["blocks_vs_auto"] = round(out[mode]["blocks_per_gib"] / out["auto"]["blocks_per_gib"], 3)
    return out


def attention_errors(contexts: tuple[int, ...], head_dim: int = 128, kv_heads: int = 8) -> list[dict]:
    rows = []
    for ctx in contexts:
        q, k, v = random_qkv(ctx, q_len=16, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim)
        for mode in ("fp16", "int8", "fp8"):
            e = attention_error(q, k, v, mode)
            rows.append(
                {
                    "context": ctx,
                    "mode": mode,
                    "max_abs": round(e.max_abs, 5),
                    "mean_abs": round(e.mean_abs, 6),
                    "rel_mean": round(e.rel_mean, 4),
                }
            )
    return rows


def model_attention_errors(model_dir, contexts: tuple[int, ...]) -> list[dict]:
    model, cfg, dtype, dev = load_model(model_dir, "float32", "cpu")
    g = torch.Generator().manual_seed(1)
    rows = []
    for ctx in contexts:
        prompt = torch.randint(5, cfg.vocab_size, (ctx,), generator=g).tolist()
        for mode in ("int8", "fp8"):
            layers = attention_output_error(model, cfg, dtype, dev, prompt, mode)
            rows.append(
                {
                    "context": ctx,
                    "mode": mode,
                    "max_abs": round(max(e.max_abs for e in layers), 5),
                    "mean_abs": round(sum(e.mean_abs for e in layers) / len(layers), 6),
                    "rel_mean": round(sum(e.mean_abs / e.ref_mean_abs for e in layers) / len(layers), 4),
                    "per_layer_rel_mean": [round(e.mean_abs / e.ref_mean_abs, 4) for e in layers],
                }
            )
    return rows


def decode_speed(model_dir, prompt_len: int, seqs: int = 4, tokens: int = 32) -> dict:
    out = {}
    for mode in MODES:
        engine = build_engine(
            model_dir, dtype="float32", device="cpu", kv_cache_gib=0.1, num_threads=1, kv_dtype=mode
        )
        steps: list[float] = []

        def on_step(s: StepStats, steps=steps) -> None:
            if s.num_prefill_seqs == 0:
                steps.append(s.duration_s)

        engine.add_step_listener(on_step)
        g = torch.Generator().manual_seed(2)
        vocab = engine.model_config.vocab_size
        prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(seqs)]
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        out[mode] = {"tpot_median_ms": round(statistics.median(steps) * 1e3, 3), "decode_batch": seqs}
    for mode in MODES[1:]:
        out[mode]["vs_auto"] = round(out[mode]["tpot_median_ms"] / out["auto"]["tpot_median_ms"], 3)
    return out


def model_agreement(model_dir, name: str, prompt_len: int, steps: int) -> dict:
    model, cfg, dtype, dev = load_model(model_dir, "float32", "cpu")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    t0 = time.perf_counter()
    rows = agreement(model, cfg, dtype, dev, prompt, steps, block_size=16)
    return {
        "model": name,
        "shape": f"{cfg.num_layers}L h{cfg.hidden_size} kv{cfg.num_kv_heads}x{cfg.head_dim}",
        "prompt_tokens": prompt_len,
        "generated_tokens": steps,
        "seconds": round(time.perf_counter() - t0, 1),
        "by_kv_dtype": {
            a.kv_dtype: {
                "free_running_agreement": round(a.free_running, 4),
                "first_divergence": a.first_divergence,
                "teacher_forced_agreement": round(a.teacher_forced, 4),
                "max_logit_diff": round(a.max_logit_diff, 5),
                "mean_logit_diff": round(a.mean_logit_diff, 6),
            }
            for a in rows
        },
    }


def judge(result: dict) -> dict:
    v = Validity()
    for name, mem in result["memory"].items():
        for mode in MODES[1:]:
            v.require(mem[mode]["bytes_per_token"] < mem["auto"]["bytes_per_token"],
                      f"{name}: {mode} KV takes no fewer bytes per token than auto")
    for key in ("attention_error", "model_attention_error"):
        for row in result[key]:
            where = f"{key} {row['mode']} at {row['context']}"
            v.require(all(math.isfinite(row[k]) for k in ("max_abs", "mean_abs", "rel_mean")), f"{where}: not finite")
            if row["mode"] in ("int8", "fp8"):
                v.require(row["mean_abs"] > 0, f"{where}: zero error: the pool was not quantized")
    for a in result["agreement"]:
        modes = a["by_kv_dtype"]
        v.require({"int8", "fp8"} <= set(modes), f"agreement ({a['model']}): modes measured {sorted(modes)}")
        v.require(all(0 <= m["teacher_forced_agreement"] <= 1 and math.isfinite(m["max_logit_diff"])
                      for m in modes.values()), f"agreement ({a['model']}): a value out of range")
    return v.as_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (long context)")
    ap.add_argument("--steps", type=int, default=512, help="generated tokens")
    ap.add_argument("--quick", action="store_true", help="short run (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.steps = 128, 64
    torch.set_num_threads(1)
    tiny_dir = ensure_tiny_model()
    tiny_cfg = ModelConfig.from_dir(tiny_dir)
    big = ModelConfig("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 8192)
    result = {
        "memory": {
            "tiny_fp32": memory(tiny_cfg, torch.float32),
            "8b_gqa_fp16": memory(big, torch.float16),
        },
        "attention_error": attention_errors((2048, 8192) if args.quick else (2048, 8192, 32768)),
        "model_attention_error": model_attention_errors(
            tiny_dir, (1024,) if args.quick else (1024, 4096, 8000)
        ),
        "decode_speed": decode_speed(tiny_dir, args.prompt),
        "agreement": [model_agreement(tiny_dir, "tiny", args.prompt, args.steps)],
    }
    with tempfile.TemporaryDirectory() as tmp:
        larger = create_tiny(
            tmp, layers=6, hidden=512, heads=8, kv_heads=4, vocab=4096, max_position_embeddings=8192, seed=1
        )
        result["agreement"].append(model_agreement(larger, "tiny-larger", args.prompt, args.steps))
    result.update(judge(result))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
