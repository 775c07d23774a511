"""Weight-only int8/int4 layers: every path (C kernel, blocked, torch fallback) computes
x @ dequantized(W)^T; quantization error is what the format allows; loading quantizes."""

from __future__ import annotations

import pytest
import torch

from tests.needs import kernel_problem, skip_without_kernels
from tierguard.model import native, qlinear
from tierguard.model.qlinear import (
    Int4Linear,
    Int8Linear,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def _dense(layer) -> torch.Tensor:
    return layer.rows(torch.arange(layer.out_features))


@pytest.fixture(params=["int8", "int4"])
def layer_and_weight(request):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(80, 96, generator=gen) * 0.05
    bias = torch.randn(80, generator=gen)
    if request.param == "int8":
        return Int8Linear.from_float(w, bias), w
    return Int4Linear.from_float(w, 32, bias), w


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 64, 65])  # 8-row kernel chunks up to 64, blocked past it
def test_forward_equals_dequantized_matmul(layer_and_weight, rows):
    layer, _w = layer_and_weight
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
    ref = x @ _dense(layer).t() + layer.bias
    out = layer(x)
    assert out.shape == (rows, layer.out_features)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    # 3-D input (batch, tokens, hidden) keeps its leading shape
    assert torch.allclose(layer(x.view(1, rows, -1)).view(rows, -1), out, atol=1e-5)


@pytest.mark.parametrize("rows", [9, 12, 13, 31])
@pytest.mark.parametrize("n, k", [(70, 100), (17, 36)])  # tiles' edges: N % 3, K % 8, M % 4
def test_int8_batched_tiles_at_odd_shapes_equal_the_dequantized_matmul(rows, n, k):
    """9-12 rows run the int8 row loop in chunks of 8 over each weight block; from 13 rows
    they go through 4 x 3 register tiles over the widened block; a weight block whose row
    count 3 does not divide, activation rows 4 does not divide and a K with a tail past its
    last 8-wide vector take the edge paths."""
    gen = torch.Generator().manual_seed(rows * n + k)
    layer = Int8Linear.from_float(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(rows, k, generator=gen)
    ref = x @ _dense(layer).t()
    torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-4)


def test_fallback_paths_match(layer_and_weight, monkeypatch):
    layer, _w = layer_and_weight
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(9))
    fast = layer(x)
    monkeypatch.setattr(native, "available", lambda: False)
    slow = layer(x)  # blocked plain torch (dequantized rows)
    tol = 1e-4
    assert torch.allclose(fast, slow, atol=tol, rtol=tol), (fast - slow).abs().max()
    monkeypatch.setattr(qlinear, "BLOCK_ROWS", 16)  # several blocks
    assert torch.allclose(layer(torch.cat([x, x])), torch.cat([slow, slow]), atol=tol, rtol=tol)


def test_quantization_error_is_bounded(layer_and_weight):
    layer, w = layer_and_weight
    err = (_dense(layer) - w).abs()
    if isinstance(layer, Int8Linear):
        g, s = w.view(80, -1, 32), layer.scale.float()
        assert bool((s >= g.abs().amax(-1) / 127 * (1 - 2**-10)).all())  # absmax / (127 - j)
        assert bool((s <= g.abs().amax(-1) / 96 * (1 + 2**-10)).all())
        # no group errs more than with Q8_0's plain absmax / 127
        plain = (g.abs().amax(-1, keepdim=True) / 127).half().float()
        plain_err = (torch.round(g / plain).clamp(-127, 127) * plain - g).pow(2).sum(-1)
        assert bool(((_dense(layer) - w).view(80, -1, 32).pow(2).sum(-1) <= plain_err * 1.0001 + 1e-12).all())
        bound = (s / 2).repeat_interleave(32, 1)  # half of its own group's step
    else:
        g = w.view(80, -1, 32)
        step = (g.amax(-1) - g.amin(-1)) / 15
        fp16 = (g.amin(-1).abs() + g.abs().amax(-1)) * 2**-10  # scale and lo are stored as float16
        bound = (step / 2 + fp16).repeat_interleave(32, 1)
    assert bool((err <= bound * 1.001 + 1e-7).all())
    assert err.max() > 0  # it is quantized


def test_int4_packing_is_gguf_q4_1_order():
    q = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    packed = pack_int4(q, 32)
    assert packed.shape == (4, 32)
    # group 0: byte j = element j (low nibble) | element j + 16 (high nibble)
    assert int(packed[1, 3]) == int(q[1, 3]) | (int(q[1, 19]) << 4)
    assert int(packed[2, 16 + 5]) == int(q[2, 32 + 5]) | (int(q[2, 32 + 21]) << 4)
    assert torch.equal(unpack_int4(packed, 32), q)


def test_quantizers_round_trip_exact_grids():
    q8 = torch.randint(-127, 128, (6, 64)).float()
    q8[:, 0], q8[:, 40] = 127, -127  # each group's absmax sets its scale
    steps = torch.tensor([[2.0**-3, 2.0**5]]).repeat(6, 1)  # exact in float16, one per group
    q, scale = quantize_int8(q8 * steps.repeat_interleave(32, 1))
    assert scale.dtype == torch.float16 and scale.shape == (6, 2)
    assert torch.equal(scale.float(), steps) and torch.equal(q.float(), q8)  # on the grid: exact
    grid = torch.randint(0, 16, (6, 32)).float()
    grid[:, 0], grid[:, 1] = 0, 15  # span the full range so min/max recover the grid
    q4, s4, lo4 = quantize_int4(grid * 0.25 - 1.0, 32)
    assert torch.allclose(q4.float() * s4.repeat_interleave(32, 1) + lo4.repeat_interleave(32, 1), grid * 0.25 - 1.0)


def _int8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w[n, k] = q[n, k] * scale[n, k // 32], element by element (independent of qlinear)."""
    n, k = q.shape
    w = torch.empty(n, k)
    for j in range(k):
        w[:, j] = q[:, j].float() * scale[:, j // 32].float()
    return w


@pytest.mark.parametrize("kernels", [True, False])  # the C kernels, or the torch fallback
@pytest.mark.parametrize("k", [64, 96, 100, 20])  # even / odd group counts; a shorter last group; one
def test_int8_groups_follow_their_own_scale(k, kernels, monkeypatch):
    """Groups whose magnitudes differ by up to 2^12: a scale read for the wrong row or
    group (or one per row) breaks every path's agreement with the float weight."""
    if kernels and not native.available():
        pytest.skip(f"the C kernels are not built: {kernel_problem()}")  # not the fallback under their name
    if not kernels:
        monkeypatch.setattr(native, "available", lambda: False)
    gen = torch.Generator().manual_seed(k)
    n = 48
    mags = 2.0 ** torch.randint(-6, 7, (n, -(-k // 32)), generator=gen).float()
    w = torch.randn(n, k, generator=gen) * mags.repeat_interleave(32, 1)[:, :k]
    layer = Int8Linear.from_float(w)
    assert layer.scale.shape == (n, -(-k // 32)) and layer.scale.dtype == torch.float16
    dense = _int8_reference(layer.qweight, layer.scale)
    assert torch.equal(_dense(layer), dense)
    # every weight within half its own group's step of the float weight
    step = _int8_reference(torch.ones_like(layer.qweight), layer.scale)
    assert bool(((dense - w).abs() <= step / 2 * 1.001 + 1e-12).all())
    for rows in (1, 2, 5, 8, 13, 70):  # C kernel (1 row: two accumulators; chunks of 8), blocked
        x = torch.randn(rows, k, generator=gen)
        ref = x.double() @ dense.double().t()
        out = layer(x).double()
        scale_ref = (x.double().abs() @ dense.double().abs().t()).clamp(min=1e-6)
        assert float(((out - ref).abs() / scale_ref).max()) < 1e-5, rows
        # and close to the float weight's product (the quantization error only)
        assert float(((out - x.double() @ w.double().t()).abs() / scale_ref).max()) < 0.01, rows


@skip_without_kernels()
@pytest.mark.parametrize("k", [96, 100])
def test_int8_scale_search_kernel_matches_torch(k, monkeypatch):
    """The C search and the torch fallback choose scales that err alike (float32 sums in
    another order may pick a different scale of equal error, rarely)."""
    w = torch.randn(70, k, generator=torch.Generator().manual_seed(k)) * 0.02
    fast = quantize_int8(w)
    monkeypatch.setattr(native, "available", lambda: False)
    slow = quantize_int8(w)

    def group_err(q, s):
        return (_int8_reference(q, s) - w).pow(2)

    assert (fast[1] == slow[1]).float().mean() > 0.97
    assert float(group_err(*fast).sum()) <= float(group_err(*slow).sum()) * 1.001
    assert float(group_err(*slow).sum()) <= float(group_err(*fast).sum()) * 1.001


def test_int8_layer_refuses_a_wrong_scale_shape():
    q, scale = quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scale"):
        Int8Linear(q, scale[:, :1])
    with pytest.raises(ValueError, match="scale"):
        Int8Linear(q, scale.float().amax(1))  # per channel: the old layout


@skip_without_kernels()
def test_kernel_refuses_more_rows_than_it_takes():
    layer = Int8Linear.from_float(torch.randn(16, 16))
    with pytest.raises(RuntimeError, match="refused"):
        native.gemv_int8(torch.randn(native.MAX_QUANT_GEMV_ROWS + 1, 16), layer.qweight, layer.scale)
    with pytest.raises(RuntimeError, match="refused"):
        native.gemv_f32(torch.randn(native.MAX_GEMV_ROWS + 1, 16), torch.randn(16, 16))


@skip_without_kernels()
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9])  # the float32 GEMV for <= 8 rows, F.linear past it
@pytest.mark.parametrize("k", [96, 100])  # a K that is not a multiple of the 32-wide unrolled loop
def test_float_linear_gemv_equals_f_linear(rows, k):
    from tierguard.model.layers import Linear, matmul_weight_t

    gen = torch.Generator().manual_seed(rows + k)
    layer = Linear(k, 70, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, k, generator=gen))
        layer.bias.copy_(torch.randn(70, generator=gen))
    x = torch.randn(2, rows, k, generator=gen)[1]  # a row-major view, not the storage's start
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        out = layer(x)
        tied = matmul_weight_t(x, layer.weight)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tied, ref - layer.bias, rtol=1e-5, atol=1e-4)


@skip_without_kernels()
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_few_rows_run_the_packed_kernel_never_a_float_weight(kind, monkeypatch):
    """Up to `gemv_rows` activation rows (decode steps) read the packed bytes through the
    kind's own GEMV, which is what makes a quantized decode step cheaper; only more rows
    dequantize, a block of output rows at a time. An int4 layer never takes int8's kernel."""
    calls: list[str] = []
    for name in ("gemv_int8", "gemv_int4", "dequant_int8", "dequant_int4", "gemv_f32"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(600, 64, generator=gen) * 0.05
    layer = Int8Linear.from_float(w) if kind == "int8" else Int4Linear.from_float(w, 32)
    for rows in (1, 8, 9, qlinear.QuantLinear.gemv_rows):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ _dense(layer).t(), rtol=1e-4, atol=1e-4)
    assert calls == [f"gemv_{kind}"] * 4
    calls.clear()
    layer(torch.randn(qlinear.QuantLinear.gemv_rows + 1, 64, generator=gen))
    assert calls == [f"dequant_{kind}"] * -(-600 // qlinear.BLOCK_ROWS)
