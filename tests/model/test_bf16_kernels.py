"""The bfloat16 panel kernel (kernels/bf16.c) computes bf16(x) . bf16(W)^T summed in float32,
on every shape and row count, on each instruction-set path this CPU can run: the
AVX512-BF16 dot products where the CPU has them, and the portable widening path a CPU
without them takes (built here with TIERGUARD_CPU_ARCH). kernels/isa.c reports what the
library was compiled for."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.needs import skip_without_kernels
from tierguard.model import native
from tierguard.model.qlinear import BF16_PANEL, Bf16Linear, pack_bf16, unpack_bf16

# Only what runs the C library skips without it (the packing and the torch fallback are
# Python and always run); tests/needs.py names why, and under CI=true fails the run instead.
needs_kernels = skip_without_kernels()

ROOT = Path(__file__).resolve().parents[2]
# (rows M, outputs N, inputs K): none of N, K a multiple of the 32-row panel or of 16 but
# one control; odd K (a zero-padded pair); N below one panel; a SmolLM2-like layer
SHAPES = [(1, 45, 77), (3, 33, 64), (37, 100, 129), (37, 7, 3), (1, 1, 1), (3, 96, 576), (37, 65, 31)]


def _inputs(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got equals bf16(x) . bf16(w)^T up to float32 summation (any order): a kernel that
    skipped the rounding of x, or read a wrong pair or panel, is off by far more."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    ref = xb @ wb.T
    bound = 1e-5 * (xb.abs() @ wb.abs().T) + 1e-30
    assert got.shape == ref.shape
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max().item()


@needs_kernels
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_bf16_matches_a_float64_reference(m, n, k):
    x, w = _inputs(m, n, k)
    _check(native.gemm_bf16(x, pack_bf16(w), n), x, w)


# Near 1, bfloat16's step is 2^-7. Each value tells round-to-nearest-even apart from
# truncation or from rounding ties up: (x, nearest-even, truncated)
ROUNDING = [
    (1 + 3 * 2.0**-9, 1 + 2.0**-7, 1.0),  # 3/4 of a step up: nearest is up, truncation keeps 1
    (1 + 2.0**-8, 1.0, 1.0),  # a tie below an even value: stays (ties up would give 1 + 2^-7)
    (1 + 3 * 2.0**-8, 1 + 2.0**-6, 1 + 2.0**-7),  # a tie above an odd value: to the even one, up
    (-(1 + 3 * 2.0**-9), -(1 + 2.0**-7), -1.0),  # the same on the negative side
    (1 + 2.0**-10, 1.0, 1.0),  # under half a step: down either way
]


@needs_kernels
def test_gemm_bf16_rounds_the_activations_to_nearest_even():
    """The rounding of x is part of the contract (the fused step and the per-row call agree
    on it): x with bits below bfloat16's gives the product of x rounded to nearest, ties to
    even, as torch rounds, not of x truncated nor of x in float32. An identity W reads
    each rounded x back on its own."""
    x = torch.tensor([[v for v, _, _ in ROUNDING]])
    got = native.gemm_bf16(x, pack_bf16(torch.eye(len(ROUNDING))), len(ROUNDING)).tolist()[0]
    assert got == [nearest for _, nearest, _ in ROUNDING]
    assert got == x.bfloat16().float().tolist()[0]  # torch's own rounding
    assert got != [truncated for _, _, truncated in ROUNDING]
    # and summed: 64 copies of 1 + 3 * 2^-9 are 64 x (1 + 2^-7), not 64 (truncated) nor 64.375
    assert native.gemm_bf16(torch.full((1, 64), ROUNDING[0][0]), pack_bf16(torch.ones(3, 64)), 3).tolist() == [
        [64.5, 64.5, 64.5]]


@pytest.mark.parametrize("n,k", [(45, 77), (1, 1), (64, 128), (33, 3)])
def test_pack_layout_round_trips_with_zero_padding(n, k):
    _, w = _inputs(1, n, k)
    packed = pack_bf16(w)
    assert tuple(packed.shape) == (-(-n // BF16_PANEL), -(-k // 2), BF16_PANEL, 2)
    ids = torch.arange(n - 1, -1, -1)
    assert torch.equal(unpack_bf16(packed, k, ids), w.bfloat16()[ids])
    full = packed.view(torch.bfloat16).transpose(1, 2).reshape(-1, packed.shape[1] * 2).float()
    assert full[n:].abs().sum() == 0 and full[:, k:].abs().sum() == 0  # padding is zero


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_torch_fallback_is_float32_over_the_unpacked_rows(bias, monkeypatch):
    """Without the library (CUDA, no compiler) the module is torch's float32 matmul over
    the unpacked bfloat16 rows: x is not rounded. Needs no kernel."""
    x, w = _inputs(37, 100, 129)
    b = torch.randn(100) if bias else None
    lin = Bf16Linear.from_float(w, b)
    monkeypatch.setattr(native, "available", lambda: False)
    fb = lin(x)
    ref = x.double() @ w.bfloat16().double().T + (b.double() if bias else 0)
    assert (fb.double() - ref).abs().max() < 1e-4


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_kernel_and_torch_fallback_agree(bias, monkeypatch):
    """The module: the kernel on the CPU; the fallback differs from it only by not
    rounding x."""
    x, w = _inputs(37, 100, 129)
    b = torch.randn(100) if bias else None
    lin = Bf16Linear.from_float(w, b)
    got = lin(x.view(37, 1, 129)).view(37, 100)
    _check(got - (b if bias else 0), x, w)
    monkeypatch.setattr(native, "available", lambda: False)
    fb = lin(x)
    # the two differ by the rounding of x only: at most 2^-8 of each |x||w| sum
    assert ((fb - got).abs() <= 2.0**-8 * (x.abs() @ w.bfloat16().float().abs().T) + 1e-5).all()


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@needs_kernels
@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(), reason="x86-64 Linux")
def test_isa_report_matches_this_cpu_and_peaks_exist_where_it_says():
    flags, got = _cpu_flags(), set(native.isa())
    assert ("avx512_bf16" in got) == ("avx512_bf16" in flags)
    assert ("avx512_vnni" in got) == ("avx512_vnni" in flags)
    assert ("avx512" in got) == ({"avx512f", "avx512bw"} <= flags)
    assert ("avx2" in got) == ({"avx2", "fma"} <= flags)
    assert native.peak_ops("float32_fma", 20_000) > 0
    assert (native.peak_ops("bfloat16_dot", 20_000) is not None) == ("avx512_bf16" in got)
    vnni = "avx512_vnni" in got or "avx_vnni" in got
    assert (native.peak_ops("int8_dot", 20_000) is not None) == vnni


_FALLBACK_SCRIPT = """
import json, sys, torch
from tierguard.model import native
from tierguard.model.qlinear import pack_bf16
out = {"isa": native.isa(), "y": []}
for m, n, k in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out["y"].append(native.gemm_bf16(x, pack_bf16(w), n).tolist())
print(json.dumps(out))
"""


def _fallback_env(arch: str) -> dict[str, str]:
    return {**os.environ, native.ARCH_ENV: arch, "PYTHONPATH": str(ROOT)}


@needs_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the fallbacks are x86-64 -march targets")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64"])
def test_fallback_builds_compute_the_same(arch):
    """Forced off the CPU's newer instructions (AVX2 only; SSE2 only), the library is built
    without them, reports so, and gives the same products up to summation order."""
    proc = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT, json.dumps(SHAPES)],
        capture_output=True, text=True, timeout=600, env=_fallback_env(arch), cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "avx512_bf16" not in out["isa"] and "avx512" not in out["isa"]
    assert ("avx2" in out["isa"]) == (arch == "x86-64-v3")
    for (m, n, k), y in zip(SHAPES, out["y"], strict=True):
        x, w = _inputs(m, n, k)
        got = torch.tensor(y, dtype=torch.float32).view(m, n)
        _check(got, x, w)
        # and the same as this CPU's own path, up to float32 summation order
        here = native.gemm_bf16(x, pack_bf16(w), n)
        assert (got - here).abs().max() <= 2e-5 * (x.bfloat16().float().abs() @ w.bfloat16().float().abs().T).max()


@needs_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the fallbacks are x86-64 -march targets")
def test_fused_steps_on_the_avx2_build_match_the_per_op_path():
    """The whole fused step (bfloat16 panels, chunk attention with its narrower tiles) on a
    library built for AVX2 only: the engine tests of the fused step, run again in a process
    that builds that library."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rA", "-p", "no:cacheprovider", "-k", "bf16 or auto",
         "tests/engine/test_fused_decode.py"],
        capture_output=True, text=True, timeout=900, env=_fallback_env("x86-64-v3"), cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.count("PASSED") >= 8 and "SKIPPED" not in proc.stdout
