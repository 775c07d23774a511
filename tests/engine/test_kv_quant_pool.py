"""The engine's device KV pool in fp8/int8: memory saved, layout, attention error, agreement."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine.conftest import hf_step_logits, make_engine, prompt_ids
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.engine.api import SamplingParams
from tierguard.engine.config import EngineConfig
from tierguard.engine.factory import build_engine
from tierguard.engine.kv_quality import agreement, attention_output_error
from tierguard.engine.model_runner import ModelRunner, kv_block_bytes, kv_layout
from tierguard.kv.quant import attention_error, random_qkv
from tierguard.model.attention import AttentionMetadata, PrefillChunk, paged_attention
from tierguard.model.config import ModelConfig
from tierguard.model.loader import load_model

QUANT = ("int8", "fp8")


def _cfg(layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> ModelConfig:
    return ModelConfig(
        "LlamaForCausalLM", 1000, kv_heads * head_dim, 4096, layers, 4 * kv_heads, kv_heads, head_dim, 4096
    )


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_block_bytes_count_scales_and_more_blocks_fit(kv_dtype):
    cfg = _cfg()
    fp16 = kv_block_bytes(cfg, 16, torch.float16)
    quant = kv_block_bytes(cfg, 16, torch.float16, kv_dtype)
    # 128 values of 1 byte + one float32 scale per token-head, against 128 x 2 bytes.
    assert quant == fp16 * (128 + 4) // 256
    blocks_per_gib = {name: GIB // b for name, b in (("fp16", fp16), (kv_dtype, quant))}
    assert blocks_per_gib[kv_dtype] / blocks_per_gib["fp16"] == pytest.approx(256 / 132, rel=1e-3)


def test_factory_sizes_a_larger_pool_for_quantized_kv(tiny_dir):
    blocks = {}
    for kv_dtype in ("auto", "int8", "fp8"):
        engine = build_engine(tiny_dir, dtype="float32", device="cpu", kv_cache_gib=0.002, kv_dtype=kv_dtype)
        blocks[kv_dtype] = engine.config.num_blocks
        assert engine.stats().extra["kv_quantized"] == float(kv_dtype != "auto")
    # Tiny model: head_dim 16 in fp32 = 64 bytes per token-head, against 16 + 4 quantized.
    assert blocks["int8"] == blocks["fp8"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(64 / 20, rel=0.01)


def test_bad_kv_dtype_is_refused():
    with pytest.raises(TierguardError, match="kv-dtype"):
        EngineConfig(num_blocks=4, kv_dtype="fp4")
    with pytest.raises(TierguardError, match="kv-dtype"):
        kv_layout(_cfg(), 16, torch.float16, "int4")


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_pool_follows_device_pool_conventions(tiny_dir, kv_dtype):
    """Scales live in a parallel tensor indexed by the same block id, so a block's payload
    (quantized bytes + scales) moves between pools the way the tiers move it."""
    model, cfg, dtype, dev = load_model(tiny_dir, "float32", "cpu")
    runner = ModelRunner(model, cfg, 8, 4, dtype, dev, kv_dtype=kv_dtype)
    layout, pool = runner.kv_layout, runner.device_pool
    assert [tuple(t.shape) for t in pool.tensors] == [layout.pool_shape(8), layout.scale_shape(8)]
    assert pool.tensors[0].dtype == layout.torch_dtype and pool.tensors[1].dtype == torch.float32
    assert pool.block_bytes == layout.block_bytes
    for t in pool.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype) if t.dtype != torch.int8 else torch.randint(-9, 9, t.shape))
    payload = torch.empty(pool.block_bytes, dtype=torch.uint8)
    for view, t in zip(pool.payload_views(payload), pool.tensors, strict=True):
        view.copy_(t[3])  # blocks first: one block is one contiguous slice
    for view, t in zip(pool.payload_views(payload), pool.tensors, strict=True):
        t[6].copy_(view)
    for t in pool.tensors:
        assert t[3].is_contiguous()
        assert torch.equal(t[6].view(torch.uint8), t[3].view(torch.uint8))


def _paged_decode(q, k, v, kv_dtype: str, block_size: int = 16) -> torch.Tensor:
    """Write k, v [ctx, KV, D] through a prefill, then attend with q [H, D] as a decode of
    the last position (its own K/V re-written); returns [H, D]."""
    ctx, kvh, d = k.shape
    n_blocks = -(-ctx // block_size)
    cfg = _cfg(layers=1, kv_heads=kvh, head_dim=d)
    layout = kv_layout(cfg, block_size, torch.float32, kv_dtype)
    runner_pool = [torch.zeros(layout.pool_shape(n_blocks), dtype=layout.torch_dtype)]
    scale_shape = layout.scale_shape(n_blocks)
    scales = None if scale_shape is None else torch.ones(scale_shape)
    slots = torch.arange(ctx)
    pre = AttentionMetadata(slot_mapping=slots[:-1], prefills=[PrefillChunk(0, ctx - 1, 0)])
    h = q.shape[0]
    paged_attention(
        torch.zeros(ctx - 1, h, d),
        k[:-1],
        v[:-1],
        runner_pool[0][:, 0],
        pre,
        None if scales is None else scales[:, 0],
    )
    blocks = torch.arange(n_blocks).unsqueeze(0)
    mask = (torch.arange(n_blocks * block_size) < ctx).view(1, 1, 1, -1)
    dec = AttentionMetadata(slot_mapping=slots[-1:], num_decodes=1, decode_blocks=blocks, decode_mask=mask)
    out = paged_attention(
        q.unsqueeze(0), k[-1:], v[-1:], runner_pool[0][:, 0], dec, None if scales is None else scales[:, 0]
    )
    return out.view(h, d)


# Keys with 8x outlier channels (as real keys have); the output averages 4096 values,
# so its mean magnitude is small (~0.14) and the relative error reads large.
@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.05), ("fp8", 0.08)])
def test_attention_error_bounded_on_long_context(kv_dtype, bound):
    ctx, heads, kvh, d = 4096, 8, 2, 64
    q, k, v = random_qkv(ctx, q_len=1, num_heads=heads, num_kv_heads=kvh, head_dim=d, seed=7)
    q1, kt, vt = q[:, 0], k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    ref = _paged_decode(q1, kt, vt, "auto")
    exact = torch.softmax((q1.view(kvh, heads // kvh, d) @ k.transpose(1, 2)) / math.sqrt(d), -1) @ v
    assert torch.allclose(ref, exact.reshape(heads, d), atol=1e-5)  # the fp32 pool is exact
    out = _paged_decode(q1, kt, vt, kv_dtype)
    rel_mean = float((out - ref).abs().mean() / ref.abs().mean())
    assert 0 < rel_mean < bound
    assert float((out - ref).abs().max()) < 2 * bound
    # The engine's path (quantize on store, dequantize gathered pages) matches the
    # reference helper's per-token-head quantization.
    assert rel_mean == pytest.approx(attention_error(q, k, v, kv_dtype).rel_mean, rel=0.05)


def test_quantized_engine_tracks_transformers(tiny_dir, hf_model):
    """Teacher-forced by construction: HF recomputes logits on the engine's own tokens."""
    hf = hf_model(tiny_dir)
    prompts = [prompt_ids(3, 40), prompt_ids(4, 9) * 3]
    errors = {}
    for kv_dtype in QUANT:
        engine = make_engine(tiny_dir, kv_dtype=kv_dtype, max_num_batched_tokens=16)
        rows: dict[str, list[torch.Tensor]] = {}

        def hook(ids, lg, rows=rows):
            for j, r in enumerate(ids):
                rows.setdefault(r, []).append(lg[j].clone())

        engine.logits_hook = hook
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        engine.check_integrity()
        worst, agree, total = 0.0, 0, 0
        for rid, prompt, out in zip(sorted(rows), prompts, outs, strict=True):
            ref = hf_step_logits(hf, prompt, out)
            worst = max(worst, float((torch.stack(rows[rid]) - ref).abs().max()))
            agree += sum(int(a == b) for a, b in zip(ref.argmax(-1).tolist(), out, strict=True))
            total += len(out)
        errors[kv_dtype] = worst
        assert agree / total >= 0.9, f"{kv_dtype}: greedy agreed with transformers on {agree}/{total}"
    assert 0 < errors["int8"] < 0.05
    assert 0 < errors["fp8"] < 0.2


def test_greedy_agreement_over_long_generation(tiny_dir):
    model, cfg, dtype, dev = load_model(tiny_dir, "float32", "cpu")
    results = {
        a.kv_dtype: a for a in agreement(model, cfg, dtype, dev, prompt_ids(0, 64), 384, block_size=16)
    }
    print({k: vars(v) for k, v in results.items()})
    # Teacher-forced: the same greedy choice at nearly every step of a long generation.
    assert results["int8"].teacher_forced >= 0.98
    assert results["fp8"].teacher_forced >= 0.95
    # int8 keeps 7 bits of mantissa-equivalent, e4m3 only 3: int8 is the closer one.
    assert results["int8"].max_logit_diff < results["fp8"].max_logit_diff
    assert results["int8"].teacher_forced >= results["fp8"].teacher_forced
    # Free-running, int8 follows the reference at least as long as fp8 does (never leaving
    # it counts as all 384 steps). The share of equal positions after a divergence compares
    # two unrelated continuations, so it is not compared.
    follows = {k: 384 if r.first_divergence is None else r.first_divergence for k, r in results.items()}
    assert follows["int8"] >= follows["fp8"], follows
    for r in results.values():  # the two figures agree with each other
        assert (r.first_divergence is None) == (r.free_running == 1.0)


def test_model_attention_error_bounded_at_long_context(tiny_dir):
    """The tiny model's own K/V, a 480-token context read back from the pool by a decode."""
    model, cfg, dtype, dev = load_model(tiny_dir, "float32", "cpu")
    prompt = prompt_ids(9, 480)
    rel = {}
    for kv_dtype in QUANT:
        layers = attention_output_error(model, cfg, dtype, dev, prompt, kv_dtype, block_size=16, chunk=128)
        assert len(layers) == cfg.num_layers
        rel[kv_dtype] = max(e.mean_abs / e.ref_mean_abs for e in layers)
        assert all(e.max_abs < 0.1 for e in layers)
    assert 0 < rel["int8"] < 0.02
    assert 0 < rel["fp8"] < 0.06
    assert rel["int8"] < rel["fp8"]
