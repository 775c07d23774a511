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


def test_long_context_attention_error_is_bounded():
    q, k, v = random_qkv(context=8192, q_len=8)
    i8 = attention_error(q, k, v, "int8")
    f8 = attention_error(q, k, v, "fp8")
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
