"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Weights keep Hugging Face's layout except that q/k/v and gate/up are fused into one
matmul each (the loader concatenates them). The model computes hidden states for a flat
batch of tokens; logits are computed only for the rows the sampler needs.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tierguard.model import fused_decode
from tierguard.model.attention import AttentionMetadata, paged_attention
from tierguard.model.config import ModelConfig
from tierguard.model.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, matmul_weight_t
from tierguard.model.qlinear import QuantEmbedding


class LayerStreamer(Protocol):
    """What the model knows of a weight offloader (tierguard/engine/weight_offload.py):
    it streams layers in through forward hooks, and reports what that costs. Kept as a
    protocol so the model never imports the engine."""

    def stats(self) -> object: ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, kvh, d)
        if self.q_norm is None or self.k_norm is None:
            # Queries and keys rotated together: one rotation per layer.
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, h + kvh, d), *rope)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, : self.q_size].view(t, h, d)), *rope)
            k = apply_rotary(self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, kvh, d)), *rope)
        return self.o_proj(paged_attention(q, k, v, kv_layer, meta, scale_layer))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_layer, meta, scale_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        # An explicit (uninitialised) weight: the loader overwrites it anyway, and nn.Embedding's
        # own normal_() init, run under the loader's `torch.device("meta")`, goes through
        # torch._refs and imports torch._dynamo - 4-5 s of CPU at every engine start.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device
        )
        # "auto" (float weights), "int8" or "int4": set by the loader (tierguard/model/quantize.py).
        self.weight_dtype = "auto"
        # Set by WeightOffloader.attach when some decoder layers live in host memory; it
        # streams them in through forward pre-hooks, so forward() itself is unchanged.
        self.weight_offloader: LayerStreamer | None = None
        # The whole-stack C decode step (fused_decode.py), built at the first decode-only
        # step on the CPU; False once it proved unusable for this model.
        self._fused: fused_decode.FusedDecoder | None | bool = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final-normed hidden states [T, hidden].

        `kv_scale` is the quantized pool's scale tensor (None for a model-dtype pool).
        """
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        call = meta.step_call if meta.step_call is not None else (None if meta.prefills else meta.decode_call)
        if call is not None and kv_scale is None and x.dtype == torch.float32:
            fused = self._fused_decoder()
            if fused is not None:
                out = fused.run(x, rope, kv_cache, call, ordered=bool(meta.prefills))
                if out is not None:
                    return out
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[:, i], meta, None if kv_scale is None else kv_scale[:, i])
        return self.norm(x)

    def make_rotary(self, device: torch.device | str) -> None:
        """(Re)build the RoPE tables on `device` (the loader builds the model on "meta")."""
        cfg = self.config
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device
        )

    def _fused_decoder(self) -> fused_decode.FusedDecoder | None:
        if self._fused is False or self.weight_offloader is not None:
            return None
        fused = self._fused
        if isinstance(fused, fused_decode.FusedDecoder) and not fused.stale():
            return None if self._hooks_below(fused.submodules) else fused
        self._fused = fused_decode.build(self) or False
        return self._fused_decoder()

    @staticmethod
    def _hooks_below(modules: list[nn.Module]) -> bool:
        """Forward hooks below the model (a capture, a profiler's scopes) must see the
        per-op modules run: the fused step would skip them, so it steps aside."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in modules)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, nn.Embedding | nn.Linear):
            return matmul_weight_t(hidden, head.weight)
        if isinstance(head, QuantEmbedding):  # tied and quantized: the same matrix
            return head.linear(hidden)
        return head(hidden)
