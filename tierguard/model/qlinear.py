"""Weight-only int8 / int4 linear layers (and the tied embedding that shares them).

Why: a batch-1 decode step reads every weight once, so its time is the weight bytes over
the memory bandwidth. int8 cuts the float32 bytes ~4x, int4 ~6x (scales included).

    int8  per group of 32 inputs: w[n, k] = q[n, k] * scale[n, k // 32]   q int8 in -127..127,
          scale float16 (symmetric; the best of 32 scales near absmax / 127, see
          quantize_int8): GGUF Q8_0's block, so Q8_0 tensors
          load unchanged (scale = d). A K that is not a multiple of 32 ends in one
          shorter group (its own scale), so every shape quantizes.
    int4  per group of `group` inputs: w[n, k] = q * scale[n, g] + lo[n, g]    q in 0..15,
          two per byte in GGUF Q4_1's order (in a group's group/2 bytes, byte j holds
          element j low and element j + group/2 high), scale and lo float16, so Q4_1
          blocks load unchanged (scale = d, lo = m) and Q4_0 ones too (scale = d, lo = -8 d)

The matmul never dequantizes the whole weight for a decode step. On the CPU, up to
`gemv_rows` (64) activation rows go to the C kernels (kernels/gemv.c: each weight
byte read once, widened in registers, float32 activations and sums), which are bound by
memory bandwidth (from 13 int8 rows or 9 int4 rows, each block of 16 weight rows is
widened to float32 once, in L2, for all the row chunks); more rows (prefill, large
batches) dequantize `BLOCK_ROWS` output rows at a time into a small float32 buffer that
torch's GEMM multiplies while it is in cache. Without the kernels (no compiler; CUDA)
the same blocks are dequantized in plain torch. (torch's `aten._weight_int8pack_mm`
takes one scale per output channel only: re-quantizing a GGUF model's group-wise values
per channel loses agreement with float32.)

torch's `_weight_int4pack_mm_for_cpu` is not used: on a CPU without AMX it is
compute-bound (bfloat16 only; its float32 path is a scalar loop), slower per step than
the C kernel, and its tiled layout hides rows from the embedding lookup.

A tied embedding is one quantized matrix: the lm_head matmul uses it as a linear layer
and the token lookup dequantizes only the rows it needs (`rows`).
"""

from __future__ import annotations

import torch
from torch import nn

from tierguard.model import native

WEIGHT_DTYPES = ("auto", "bf16", "int8", "int4")
INT4_GROUPS = (32, 64, 128)
INT8_GROUP = 32  # GGUF Q8_0's block; the C kernels assume it
INT8_SCALE_CANDIDATES = 32  # scales absmax / (127 - j) tried per group (quantize_int8)
BLOCK_ROWS = 512  # output rows dequantized at once for many activation rows


def int8_groups(k: int) -> int:
    """Scales per row: K / 32, rounded up (a last, shorter group)."""
    return -(-k // INT8_GROUP)


def int8_scale_columns(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[N, groups] group scales -> [N, K] float32, each scale over its group's columns."""
    return scale.float().repeat_interleave(INT8_GROUP, dim=1)[:, :k]


def _int8_search_torch(g: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's search in plain torch: g [R, G, 32] -> (q [R, G, 32], best [R, G])."""
    best_err = best = best_q = None
    for j in range(cand.shape[-1]):
        s = cand[..., j : j + 1]
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp_(-127, 127)
        err = (q * s - g).pow(2).sum(-1)
        if best_err is None:
            best_err, best, best_q = err, torch.zeros_like(err, dtype=torch.long), q
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, j, best)
            best_q = torch.where(better.unsqueeze(-1), q, best_q)
    return best_q, best


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (row, group of 32 inputs), as GGUF Q8_0:
    (q [N, K] int8, scale [N, ceil(K / 32)] float16).

    Each group's scale is the one of the float16 values absmax / (127 - j), j < 32, whose
    rounded q has the least squared error (j = 0 is Q8_0's plain absmax / 127), and q is
    rounded against that stored float16 scale. Why: a Q4_1 model's values re-quantized
    with absmax / 127 alone fall short of the greedy agreement with float32 that int8
    should keep, and the search closes most of that gap (bench/weight_quant_quality.py).
    The C kernel searches in seconds; the torch fallback computes the same, slowly."""
    w = w.detach().float().cpu().contiguous()
    n, k = w.shape
    ng, pad = int8_groups(k), int8_groups(k) * INT8_GROUP - k
    div = 127.0 - torch.arange(INT8_SCALE_CANDIDATES, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, ng, dtype=torch.float16)
    for r0 in range(0, n, 1024):  # the candidates of 1024 rows at a time
        rows = w[r0 : r0 + 1024]
        g = torch.nn.functional.pad(rows, (0, pad)).view(len(rows), ng, INT8_GROUP)
        cand = (g.abs().amax(-1, keepdim=True) / div).clamp_(max=65504.0).half().float()
        if native.available():
            best = torch.empty(len(rows), ng, dtype=torch.uint8)
            native.quantize_int8(rows, cand, q[r0 : r0 + len(rows)], best)
            best = best.long()
        else:
            gq, best = _int8_search_torch(g, cand)
            q[r0 : r0 + len(rows)] = gq.to(torch.int8).view(len(rows), -1)[:, :k]
        scale[r0 : r0 + len(rows)] = cand.gather(-1, best.unsqueeze(-1)).squeeze(-1).half()
    return q, scale


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group, as GGUF Q4_1): q [N, K] uint8 in
    0..15, scale and lo [N, K / group] float32, with w ~ q * scale + lo."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K / 2] bytes in the Q4_1 order (see the module doc)."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // group, 2, group // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of pack_int4: [N, K / 2] bytes -> [N, K] values."""
    n, half_k = packed.shape
    b = packed.view(n, half_k * 2 // group, group // 2)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(n, half_k * 2)


class QuantLinear(nn.Module):
    """Common part: shapes, optional float bias, the many-rows path, byte count."""

    # Rows up to which the C GEMV (8 rows at a time over each cached weight block) is used
    # instead of dequantize-then-GEMM: the whole fused step's limit. Up to it, a batch of
    # quantized decodes outruns float32 weights (`python -m tierguard.engine.speed`).
    gemv_rows = native.MAX_QUANT_GEMV_ROWS

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and native.available():
            xf = x2.float().contiguous()
            if xf.shape[0] <= self.gemv_rows:
                y = self._gemv(xf)
            else:
                y = self._blocked(xf, self._dequant_native)
        else:
            y = self._fallback(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _blocked(self, x: torch.Tensor, dequant) -> torch.Tensor:
        """x @ W^T with W dequantized BLOCK_ROWS output rows at a time."""
        n = self.out_features
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        buf = torch.empty(min(n, BLOCK_ROWS), self.in_features, dtype=x.dtype, device=x.device)
        for s in range(0, n, BLOCK_ROWS):
            e = min(n, s + BLOCK_ROWS)
            torch.matmul(x, dequant(s, e, buf).t(), out=out[:, s:e])
        return out

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        return self._blocked(x, lambda s, e, buf: buf[: e - s].copy_(self.rows_range(s, e, x.dtype)))

    def rows_range(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(start, end, device=self.scale.device), dtype)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


class Int8Linear(QuantLinear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        want = (self.out_features, int8_groups(self.in_features))
        if q.dtype != torch.int8 or tuple(scale.shape) != want:
            raise ValueError(f"int8 layer needs q int8 [N, K] and scale [N, ceil(K/32)] = {want}, "
                             f"got {q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}")
        self.register_buffer("qweight", q.contiguous())
        # float16, as GGUF Q8_0 stores it: 2 bytes per 32 weights (1.0625 bytes per weight)
        self.register_buffer("scale", scale.to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        return cls(*quantize_int8(w), bias)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return native.gemv_int8(x, self.qweight, self.scale)

    def _dequant_native(self, s: int, e: int, buf: torch.Tensor) -> torch.Tensor:
        return native.dequant_int8(self.qweight, self.scale, s, e, buf)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows `ids` (the tied embedding's lookup; the torch fallback's blocks)."""
        q = self.qweight.index_select(0, ids).float()
        w = q * int8_scale_columns(self.scale.index_select(0, ids), self.in_features)
        return w.to(dtype)


class Int4Linear(QuantLinear):
    def __init__(
        self, packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if group not in INT4_GROUPS:
            raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
        n, half_k = packed.shape
        self.out_features, self.in_features = n, half_k * 2
        self.group = group
        self.register_buffer("qweight", packed.contiguous())
        # float16, as GGUF stores them: 4 bytes per group instead of 8 (0.625 bytes per weight)
        self.register_buffer("scale", scale.to(torch.float16).contiguous())
        self.register_buffer("lo", lo.to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def supports(shape: tuple[int, int], group: int) -> bool:
        return shape[1] % group == 0

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int, bias: torch.Tensor | None = None) -> Int4Linear:
        q, scale, lo = quantize_int4(w, group)
        return cls(pack_int4(q, group), scale, lo, group, bias)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return native.gemv_int4(x, self.qweight, self.scale, self.lo, self.group)

    def _dequant_native(self, s: int, e: int, buf: torch.Tensor) -> torch.Tensor:
        return native.dequant_int4(self.qweight, self.scale, self.lo, self.group, s, e, buf)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = unpack_int4(self.qweight.index_select(0, ids), self.group).float()
        q = q.view(len(ids), -1, self.group)
        scale = self.scale.index_select(0, ids).float().unsqueeze(-1)
        w = q * scale + self.lo.index_select(0, ids).float().unsqueeze(-1)
        return w.view(len(ids), -1).to(dtype)


BF16_PANEL = 32  # TG_BF16_NR in kernels/tg_kernels.h: weight rows per panel


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> bfloat16 (rounded to nearest even) in the kernels' panel layout
    (kernels/bf16.c): int16 [ceil(N / 32), ceil(K / 2), 32, 2], element (p, kp, j, t) =
    w[32 p + j, 2 kp + t], zero past N and K."""
    n, k = w.shape
    panels, kh = -(-n // BF16_PANEL), -(-k // 2)
    padded = torch.zeros(panels * BF16_PANEL, 2 * kh, dtype=torch.bfloat16, device=w.device)
    padded[:n, :k] = w.detach()
    return padded.view(panels, BF16_PANEL, kh, 2).transpose(1, 2).contiguous().view(torch.int16)


def unpack_bf16(packed: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a packed weight (pack_bf16) as bfloat16 [len(ids), K]."""
    ids = ids.to(device=packed.device, dtype=torch.long)
    rows = packed.view(torch.bfloat16)[ids // BF16_PANEL, :, ids % BF16_PANEL]  # [n, K / 2, 2]
    return rows.reshape(len(ids), -1)[:, :k]


class Bf16Linear(QuantLinear):
    """bfloat16 weights with float32 activations (`--weight-dtype bf16`): each matmul rounds
    its input rows to bfloat16 and sums in float32 (kernels/bf16.c, AVX512-BF16 dot
    products where the CPU has them). Why: steps of many rows are bound by arithmetic, and
    the bfloat16 dot product does twice float32's multiply-adds per instruction from half
    the bytes, while the residual stream, norms, attention and KV stay float32. Every row
    count goes to the kernel; without it (no compiler, CUDA) the rows are unpacked
    BLOCK_ROWS at a time for torch's matmul in float32."""

    gemv_rows = 1 << 62  # the kernel takes every row count

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        want = (-(-out_features // BF16_PANEL), -(-in_features // 2), BF16_PANEL, 2)
        if packed.dtype != torch.int16 or tuple(packed.shape) != want:
            raise ValueError(f"bf16 layer needs packed int16 {want}, got {packed.dtype} {tuple(packed.shape)}")
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("packed", packed.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Bf16Linear:
        return cls(pack_bf16(w), w.shape[0], w.shape[1], bias)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        return native.gemm_bf16(x, self.packed, self.out_features)

    def rows_range(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(start, end, device=self.packed.device), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return unpack_bf16(self.packed, self.in_features, ids).to(dtype)


class QuantEmbedding(nn.Module):
    """Token lookup from a quantized [vocab, hidden] matrix, which the lm_head shares
    (tied embeddings): one copy of the bytes."""

    def __init__(self, linear: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = linear
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear.rows(ids, self.dtype)
