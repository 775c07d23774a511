"""Gemma 3 (text) over the paged KV cache, on the torch path.

What sets it apart from a Llama (transformers' modeling_gemma3 is the reference):
- RMSNorm scales by (1 + w), computed in float32; every layer norms four times: before
  and after attention, before and after the MLP (the "sandwich");
- q and k are RMS-normed per head before RoPE; queries are scaled by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- the embedding is multiplied by sqrt(hidden_size); the lm_head is the embedding;
- the MLP is GeGLU with the tanh GELU;
- sliding layers use RoPE base `rope_local_theta` and see only the last
  `sliding_window` positions; full layers use `rope_theta` (and its scaling).

KV: the pool is split into layer groups (tierguard/kv/groups.py): layer i reads slot
`placement[i][1]` of the pool through group `placement[i][0]`'s attention metadata
(`meta.groups`, built by the runner: decode gathers and masks only the window's blocks
for sliding groups). Attention is `paged_attention` with SDPA; the Llama-only fused C
decode step and the native attention kernel are never used.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tierguard.kv.groups import KVGroups
from tierguard.model.attention import AttentionMetadata, paged_attention
from tierguard.model.config import ModelConfig
from tierguard.model.layers import Linear, RotaryEmbedding, apply_rotary
from tierguard.model.llama import LlamaModel

# What the engine reports as this model's compute path (serve's ready line, logs).
COMPUTE_PATH = "torch (SDPA attention; no fused C decode step)"


def kv_groups(cfg: ModelConfig) -> KVGroups:
    """The pool's layer groups for this model (one group when no layer slides)."""
    return KVGroups.from_layer_windows(cfg.layer_windows())


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, cast back (Gemma's checkpoints store w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.sliding = window is not None
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, x, rope, kv_layer, meta: AttentionMetadata, scale_layer=None) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d))
        v = qkv[:, self.q_size + self.kv_size :].view(t, kvh, d)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(paged_attention(q, k, v, kv_layer, meta, scale_layer, scale=self.scale))


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, rope, kv_layer, meta, scale_layer=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, kv_layer, meta, scale_layer)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    """Same interface as LlamaModel (forward over a flat batch, compute_logits)."""

    compute_path = COMPUTE_PATH

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        windows = cfg.layer_windows()
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, w) for w in windows)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.groups = kv_groups(cfg)
        self.placement = self.groups.placement()
        self.sliding = [w is not None for w in windows]
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.make_rotary(device)
        self.weight_dtype = "auto"
        self.weight_offloader = None
        self._fused = False  # the fused C decode step is Llama's; never built here

    def make_rotary(self, device: torch.device | str) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device
        )
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta or 10000.0, None, device
        )

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata, kv_scale=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the scale cast to the embedding's dtype.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = (self.rotary.tables(positions, x.dtype), self.rotary_local.tables(positions, x.dtype))
        metas = meta.groups or [meta]
        for i, layer in enumerate(self.layers):
            g, slot = self.placement[i]
            scale = None if kv_scale is None else kv_scale[:, slot]
            x = layer(x, ropes[self.sliding[i]], kv_cache[:, slot], metas[g], scale)
        return self.norm(x)
