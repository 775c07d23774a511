"""Building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Numerics follow transformers' reference implementations (norm in float32, rotary tables
in float32 then cast), so fp32 logits agree with them to ~1e-5.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tierguard.common.errors import TierguardError
from tierguard.model import native


class Linear(nn.Linear):
    """nn.Linear whose few-row float32 CPU matmul (a decode step) is the C GEMV.

    Why: a batch-1 step reads every weight once, which is most of a float32 step, and on
    small layer shapes torch's GEMV reads well below the memory bandwidth that the C loop
    reaches (kernels/gemv.c, tg_gemv_f32). Other shapes, dtypes and devices use F.linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= native.MAX_GEMV_ROWS and native.fused_ok(x, self.weight):
            y = native.gemv_f32(x.reshape(rows, self.in_features), self.weight)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def matmul_weight_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (the tied lm_head), through the C GEMV where Linear would use it."""
    rows = x.numel() // weight.shape[1]
    if rows <= native.MAX_GEMV_ROWS and native.fused_ok(x, weight):
        return native.gemv_f32(x.reshape(rows, weight.shape[1]), weight).view(*x.shape[:-1], weight.shape[0])
    return x @ weight.t()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call instead of seven ops (the C kernel on the CPU), same arithmetic.
            if native.fused_ok(x, self.weight):
                return native.rms_norm(x, self.weight, self.eps)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with Llama 3 / linear scaling applied when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise TierguardError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (non-interleaved halves).

    Deliberately not an nn.Module: the tables stay float32 whatever dtype the model is
    cast to (they are cast per use, like the reference implementation).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq.to("cpu"))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        # sin with the first half negated: rotate_half(x) * sin == swap_halves(x) * sin_signed
        # (the two halves of `sin` are equal), so rotation needs no negation op.
        half = head_dim // 2
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, shaped [T, 1, D] to broadcast over heads.

        Computed once per forward pass and shared by all layers.
        """
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, self.sin_signed.index_select(0, positions).unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x: [T, N, D] (queries and keys together: N = H + KV heads).

    Equals transformers' `x * cos + rotate_half(x) * sin` bit for bit (same products and
    sums), in three ops instead of seven per tensor.
    """
    d = x.shape[-1]
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


class SwiGLU(nn.Module):
    """gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if native.fused_ok(gate_up):
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
