from __future__ import annotations

import pytest
import torch

from tierguard.kv.quant import (
    attention_error,
    bytes_per_token,
    dequantize,
    quantize,
    random_qkv,
    read_slots,
    token_agreement,
    write_slots,
)
from tierguard.kv.spec import DevicePool, KVLayout


@pytest.mark.parametrize("mode,bound", [("int8", 0.5 / 127), ("fp8", 1 / 16)])
def test_roundtrip_error_is_within_the_format_step(mode, bound):
    x = torch.randn(64, 4, 32) * torch.logspace(-2, 2, 64).view(64, 1, 1)
    q, s = quantize(x, mode)
    assert s.shape == (64, 4) and s.dtype == torch.float32
    err = (dequantize(q, s) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert float(err.max()) <= bound + 1e-6  # relative to each token-head's range


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out here, one head at a time (not the product's):
    query head h reads KV head h // (heads / kv_heads); query i of the last q_len sees keys
    0 .. ctx - q_len + i."""
    heads, q_len, d = q.shape
    ctx, group = k.shape[1], heads // k.shape[0]
    out = torch.empty(heads, q_len, d)
    for h in range(heads):
        kh, vh = k[h // group].float(), v[h // group].float()
        scores = (q[h].float() @ kh.T) / d**0.5  # [q_len, ctx]
        for i in range(q_len):
            scores[i, ctx - q_len + i + 1 :] = float("-inf")
        w = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        out[h] = (w / w.sum(dim=1, keepdim=True)) @ vh
    return out


def test_long_context_attention_error_is_bounded():
    q, k, v = random_qkv(context=8192, q_len=8)
    # The product's error figures, checked against attention written independently here.
    ref = _reference_attention(q, k, v)
    got = {}
    for mode in ("int8", "fp8"):
        deq = [dequantize(*quantize(x, mode)) for x in (k, v)]
        diff = (_reference_attention(q, *deq) - ref).abs()
        got[mode] = attention_error(q, k, v, mode)
        assert got[mode].max_abs == pytest.approx(float(diff.max()), rel=1e-3, abs=1e-6)
        assert got[mode].mean_abs == pytest.approx(float(diff.mean()), rel=1e-3)
        assert got[mode].ref_mean_abs == pytest.approx(float(ref.abs().mean()), rel=1e-4)
    i8, f8 = got["int8"], got["fp8"]
    f8t = attention_error(q, k, v, "fp8", granularity="tensor")
    assert i8.context == 8192
    assert i8.rel_mean < 0.08 and i8.max_abs < 0.15
    assert f8.rel_mean < 0.12 and f8.max_abs < 0.2
    assert f8.mean_abs < f8t.mean_abs  # per-token-head scales beat one scale with outlier keys
    assert i8.mean_abs > 0  # it is a real measurement, not a no-op


def test_bytes_per_token_counts_scales():
    assert bytes_per_token(32, 8, 128, "none") == 32 * 8 * 128 * 2 * 2  # 128 KiB, R2's example
    assert bytes_per_token(32, 8, 128, "int8") == 32 * 2 * 8 * (128 + 4)
    assert bytes_per_token(32, 8, 128, "fp8") == bytes_per_token(32, 8, 128, "int8")


@pytest.mark.parametrize("mode", ["none", "int8", "fp8"])
def test_pool_slots_roundtrip(mode):
    dtype = {"none": "float16", "int8": "int8", "fp8": "float8_e4m3fn"}[mode]
    layout = KVLayout(2, 2, 16, 4, dtype, mode)
    pool = DevicePool.allocate(layout, num_blocks=4)
    scale = pool.tensors[1] if mode != "none" else None
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    slots = torch.tensor([1, 2, 3, 8, 9, 15])
    write_slots(pool.tensors[0], scale, 1, slots, k, v, mode)
    k2, v2 = read_slots(pool.tensors[0], scale, 1, slots, mode)
    tol = {"none": 1e-2, "int8": 3e-2, "fp8": 0.15}[mode]
    assert torch.allclose(k2, k, atol=tol) and torch.allclose(v2, v, atol=tol)
    assert float(pool.tensors[0][:, 0].float().abs().sum()) == 0  # layer 0 untouched


def test_token_agreement():
    assert token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert token_agreement([1, 2], [1, 2, 3]) == (1.0, None)
