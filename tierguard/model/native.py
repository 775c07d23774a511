"""tierguard's CPU kernels (kernels/*.c): built once, loaded with ctypes.

The library holds every kernel family (kernels/tg_kernels.h describes them): decode
attention over the paged KV pool, float32 / int8 / int4 GEMV and their register tiles,
RMSNorm and SiLU x up, and the fused decode step of a whole layer stack
(fused_decode.py drives it). This module builds it, declares each entry point's argument
types and wraps the per-op ones for torch tensors.

Why C and not torch: on CPU a decode step is too short for eager torch's per-op cost,
and torch has no op that reads a paged KV pool in place. The kernels are plain C (no
torch headers), so building them takes seconds with the system compiler; the shared
object is cached under `$TIERGUARD_CACHE/kernels/` keyed by every source and header,
the flags, the compiler and the CPU's flags, and renamed into place atomically. The
files are compiled apart and, with GCC, linked with link-time optimisation, so the
helpers one family takes from another inline as they would within one file.

Without a compiler, after a failed build, or with `TIERGUARD_NATIVE=0`, `available()` is
False and every caller takes its torch path (attention.py, qlinear.py, layers.py), which
computes the same result. The kernels' OpenMP regions run on torch's own OpenMP runtime
(the shared object's libgomp.so.1 resolves to the one torch already loaded), so both
share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNELS.glob("*.c"))  # one translation unit per kernel family
HEADERS = sorted(KERNELS.glob("*.h"))  # part of the build key
# -ffast-math lets the compiler vectorize expf (glibc's libmvec) and the dot products'
# reductions; the kernels use no infinities or NaNs (scores start at -FLT_MAX). It is a
# compile flag only (the link-time optimiser takes it from the objects): linked with it,
# GCC < 13 adds crtfastmath.o, whose constructor turns on flush-to-zero for the whole
# process (Python floats included) when the library loads.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c99"]
LINK_FLAGS = ["-shared", "-fopenmp", "-O3", "-march=native", "-fPIC"]
# The kernels pick their instruction sets when they are compiled (`#if defined(__AVX512BF16__)`
# and the like), for the CPU they run on. TIERGUARD_CPU_ARCH names another -march (e.g.
# x86-64-v3: AVX2 only; x86-64: SSE2 only), so the fallbacks an older CPU would take can be
# built and checked on a newer one; the target must be one this CPU can run.
ARCH_ENV = "TIERGUARD_CPU_ARCH"
# GCC's link-time optimisation over the whole library as one unit, as if it were one file.
LTO_FLAGS, LTO_LINK_FLAGS = ["-flto"], ["-flto", "-flto-partition=one"]
ABI_VERSION = 10


class DecodeArgs(ctypes.Structure):
    """Mirror of tg_decode_args in kernels/tg_kernels.h (same order and types)."""

    _fields_ = [
        ("batch", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("q_stride", ctypes.c_int64),
        ("k_stride", ctypes.c_int64),
        ("v_stride", ctypes.c_int64),
        ("blk_stride", ctypes.c_int64),
        ("v_offset", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("work_stride", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("q", ctypes.c_void_p),
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        ("pool", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
    ]


def _cache_dir() -> Path:
    env = os.environ.get("TIERGUARD_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "tierguard") / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _machine() -> str:
    """-march=native code is only valid on this CPU: its flags are part of the key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def compiler_flags(version: str) -> tuple[list[str], list[str]]:
    """(compile, link) flags for the compiler whose `--version` text this is: with LTO for
    GCC; another compiler (clang needs a linker plugin for LTO) builds the same files
    without it, correct but with the shared helpers called across files."""
    march = f"-march={os.environ.get(ARCH_ENV) or 'native'}"
    flags, link_flags = ([march if f == "-march=native" else f for f in fl] for fl in (FLAGS, LINK_FLAGS))
    if "clang" in version.lower():
        return flags, link_flags
    return flags + LTO_FLAGS, link_flags + LTO_LINK_FLAGS


def build(cc: str) -> Path:
    """Compile (or reuse) the shared object; raises RuntimeError with the compiler's words."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags, link_flags = compiler_flags(version)
    texts = [f"{f.name}\0{f.read_text()}" for f in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        "\0".join([*texts, " ".join(flags + link_flags), version, _machine()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"tg_cpu_{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        objs = [str(workdir / f"{src.stem}.o") for src in SOURCES]
        tmp = str(workdir / "lib.so")
        cmds = [[cc, *flags, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objs, strict=True)]
        for cmd in [*cmds, [cc, *link_flags, *objs, "-o", tmp, "-lm"]]:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (disabled, no compiler, or a failed build)."""
    if os.environ.get("TIERGUARD_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: the CPU kernels are off (torch paths)")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable (%s): using the torch paths", exc)
        return None
    if lib.tg_abi_version() != ABI_VERSION:
        log.warning("CPU kernels have another ABI version: using the torch paths")
        return None
    lib.tg_decode_attention_f32.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.tg_decode_attention_f32.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tg_gemv_f32.argtypes = [p, i64, i64, p, i64, p, i64]
    lib.tg_gemv_f32.restype = ctypes.c_int
    lib.tg_gemv_int8.argtypes = [p, i64, i64, p, p, i64, p, i64]
    lib.tg_gemv_int8.restype = ctypes.c_int
    lib.tg_gemv_int4.argtypes = [p, i64, i64, p, p, p, i64, i64, p, i64]
    lib.tg_gemv_int4.restype = ctypes.c_int
    lib.tg_quantize_int8.argtypes = [p, i64, i64, p, i64, p, p]
    lib.tg_quantize_int8.restype = None
    lib.tg_dequant_int8.argtypes = [p, p, i64, i64, i64, p]
    lib.tg_dequant_int8.restype = None
    lib.tg_dequant_int4.argtypes = [p, p, p, i64, i64, i64, i64, p]
    lib.tg_dequant_int4.restype = None
    lib.tg_rms_norm.argtypes = [p, p, p, p, i64, i64, ctypes.c_float]
    lib.tg_rms_norm.restype = None
    lib.tg_silu_mul.argtypes = [p, p, i64, i64]
    lib.tg_silu_mul.restype = None
    lib.tg_decode_step_scratch.argtypes = [p, i64, i64]
    lib.tg_decode_step_scratch.restype = ctypes.c_int64
    lib.tg_decode_step.argtypes = [p]
    lib.tg_decode_step.restype = ctypes.c_int
    lib.tg_gemm_bf16.argtypes = [p, i64, i64, p, i64, p, i64]
    lib.tg_gemm_bf16.restype = ctypes.c_int
    lib.tg_isa.argtypes = []
    lib.tg_isa.restype = ctypes.c_int64
    lib.tg_peak.argtypes = [i64, i64]
    lib.tg_peak.restype = ctypes.c_double
    return lib


def available() -> bool:
    return library() is not None


def supports(kv_layer: torch.Tensor, dtype: torch.dtype, heads: int, kv_heads: int) -> bool:
    """The kernel covers float32 pools and queries on the CPU, group sizes up to 64, and
    a pool whose slots are contiguous [kv_heads, head_dim] rows (always, for the pool
    tierguard.kv.spec allocates)."""
    _n, _two, _bs, kvh, d = kv_layer.shape
    return (
        kv_layer.device.type == "cpu"
        and kv_layer.dtype == torch.float32
        and dtype == torch.float32
        and heads // kv_heads <= 64
        and kv_layer.stride()[2:] == (kvh * d, d, 1)
        and available()
    )


class DecodeCall:
    """The per-step part of the kernel's arguments, built once per step; each layer then
    sets its own pointers (q, new K/V, its pool view, out) and calls `run`."""

    def __init__(
        self,
        tables: torch.Tensor,
        rows: torch.Tensor,
        ctx: torch.Tensor,
        max_ctx: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
    ) -> None:
        batch = rows.numel()
        self.tables, self.rows, self.ctx = tables, rows, ctx  # keep them alive
        self.work = torch.empty(batch * heads, max_ctx, dtype=torch.float32)
        self.args = DecodeArgs(
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            table_stride=tables.stride(0),
            work_stride=max_ctx,
            scale=head_dim**-0.5,
            tables=tables.data_ptr(),
            rows=rows.data_ptr(),
            ctx=ctx.data_ptr(),
            work=self.work.data_ptr(),
        )
        self._fn = library().tg_decode_attention_f32
        self._ref = ctypes.byref(self.args)

    def run(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_layer: torch.Tensor
    ) -> torch.Tensor:
        """q: [B, H, D]; k_new, v_new: [B, KV, D], each token's heads contiguous (any
        stride between tokens); kv_layer: [N, 2, bs, KV, D] (a layer's view). Returns
        [B, H * D]. Writes the new K/V into the pool first."""
        a = self.args
        out = torch.empty(a.batch, a.heads * a.head_dim, dtype=torch.float32)
        a.q_stride, a.k_stride, a.v_stride = q.stride(0), k_new.stride(0), v_new.stride(0)
        a.blk_stride = kv_layer.stride(0)
        a.v_offset = kv_layer.stride(1)
        a.q, a.k_new, a.v_new = q.data_ptr(), k_new.data_ptr(), v_new.data_ptr()
        a.pool, a.out = kv_layer.data_ptr(), out.data_ptr()
        if self._fn(self._ref) != 0:
            raise RuntimeError("CPU decode kernel: group size over 64")
        return out


# -- weight-only int8 / int4 matmuls (tierguard/model/qlinear.py holds the layouts) ------
MAX_GEMV_ROWS = 8  # TG_MAX_M in kernels/tg_kernels.h
MAX_QUANT_GEMV_ROWS = 64  # TG_MAX_BATCH: int8/int4 rows in chunks of 8, each weight block read once


def gemv_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M <= 8, K] float32 contiguous; w float32 [N, K] contiguous. Returns [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if library().tg_gemv_f32(x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), n) != 0:
        raise RuntimeError(f"tg_gemv_f32 refused shape M={m}")
    return y


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M <= 64, K] float32 contiguous; q int8 [N, K]; scale float16 [N, ceil(K / 32)]
    (qlinear.Int8Linear's layout). Returns [M, N]."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = library().tg_gemv_int8(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), n, y.data_ptr(), n)
    if rc != 0:
        raise RuntimeError(f"tg_gemv_int8 refused shape M={m}")
    return y


def quantize_int8(w: torch.Tensor, cand: torch.Tensor, q: torch.Tensor, best: torch.Tensor) -> None:
    """w float32 [N, K] contiguous; cand float32 [N, ceil(K/32), J] candidate scales; fills
    q int8 [N, K] and best uint8 [N, ceil(K/32)] (the chosen candidate's index)."""
    n, k = w.shape
    library().tg_quantize_int8(w.data_ptr(), n, k, cand.data_ptr(), cand.shape[-1], q.data_ptr(), best.data_ptr())


def gemv_int4(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M <= 64, K] float32 contiguous; q uint8 [N, K / 2]; scale, lo float16 [N, K / group]."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = library().tg_gemv_int4(
        x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), lo.data_ptr(), group, n, y.data_ptr(), n
    )
    if rc != 0:
        raise RuntimeError(f"tg_gemv_int4 refused shape M={m} K={k} group={group}")
    return y


def dequant_int8(q: torch.Tensor, scale: torch.Tensor, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, end) of an int8 weight (q int8 [N, K], scale float16 [N, ceil(K / 32)])
    as float32 into out[: end - start] (contiguous [rows, K])."""
    k = q.shape[1]
    library().tg_dequant_int8(q.data_ptr(), scale.data_ptr(), k, start, end, out.data_ptr())
    return out[: end - start]


def dequant_int4(
    q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group: int, start: int, end: int, out: torch.Tensor
) -> torch.Tensor:
    k = q.shape[1] * 2
    library().tg_dequant_int4(q.data_ptr(), scale.data_ptr(), lo.data_ptr(), k, group, start, end, out.data_ptr())
    return out[: end - start]


# -- bfloat16 weights in panels (kernels/bf16.c holds the layout) ------------------------------
def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] float32 contiguous against a [N, K] weight in panels (qlinear.pack_bf16).
    Returns [M, N]."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if library().tg_gemm_bf16(x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(), n) != 0:
        raise MemoryError(f"tg_gemm_bf16: no memory for {m} rows' bfloat16 copy")
    return y


# -- instruction sets and peaks (kernels/isa.c) -----------------------------------------------
ISA_FLAGS = {"avx2": 1, "avx512": 2, "avx512_bf16": 4, "avx512_vnni": 8, "avx_vnni": 16}
PEAK_KINDS = {"float32_fma": 0, "bfloat16_dot": 1, "int8_dot": 2}


def isa() -> list[str]:
    """The instruction sets the kernels were compiled with (those of this CPU), by name."""
    lib = library()
    flags = lib.tg_isa() if lib is not None else 0
    return [name for name, bit in ISA_FLAGS.items() if flags & bit]


def peak_ops(kind: str, iters: int = 2_000_000) -> float | None:
    """Operations per second (a multiply-add counts two) of one instruction kind
    (PEAK_KINDS) on torch's thread count, or None where the CPU lacks it."""
    lib = library()
    if lib is None:
        return None
    rate = lib.tg_peak(PEAK_KINDS[kind], iters)
    return rate if rate > 0 else None


# -- fused small ops (float32, contiguous rows) ---------------------------------------------
def fused_ok(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to the small fused kernels: float32, CPU, contiguous.
    (Called per op on the decode path: kept to attribute reads.)"""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x's rows; with `residual`, residual += x first (in place) and its rows
    are normalised."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    library().tg_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [rows, 2 * inter] projection."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    library().tg_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out
