"""Weight bytes from the architecture, total and per GPU under TP/PP.

Counted per layer: attention (GQA, MLA, linear attention or Mamba mixer), MLP or MoE
experts (+ router, shared experts), norms; plus embeddings, the LM head unless tied,
and the RoPE cos/sin cache engines keep. Linear layers use the weight format; norms and
(except for GGUF) embeddings stay at 16 bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierguard.plan.config import ModelSpec
from tierguard.plan.dtypes import WeightFormat
from tierguard.plan.kv import stage_layers


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one layer; `replicated` is held whole on every TP rank."""

    split: int  # divided across TP ranks
    replicated: int  # norms, replicated KV projections, MLA down-projections
    experts: int = 0  # the part of `split` that is routed-expert weights


def _attention(spec: ModelSpec, tp: int) -> LayerParams:
    h, hd = spec.hidden_size, spec.head_dim
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q_down, q_up = h * m.q_lora_rank + m.q_lora_rank, m.q_lora_rank * spec.num_heads * qk
        else:
            q_down, q_up = 0, h * spec.num_heads * qk
        kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_up = m.kv_lora_rank * spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = spec.num_heads * m.v_head_dim * h
        return LayerParams(q_up + kv_up + o, q_down + kv_down)
    q = h * spec.num_heads * hd
    kv = 2 * h * spec.num_kv_heads * hd
    bias = (spec.num_heads + 2 * spec.num_kv_heads) * hd if spec.qkv_bias else 0
    o = spec.num_heads * hd * h
    # When tp > kv heads every rank keeps whole KV heads: tp/kv copies of the projection.
    kv_copies = max(1, spec.num_kv_heads // tp) * tp / spec.num_kv_heads
    return LayerParams(q + o + bias + int(kv * kv_copies), 0)


def _mixer(spec: ModelSpec, kind: str) -> int:
    """Parameters of a constant-state mixer (approximate: projections dominate)."""
    h = spec.hidden_size
    ex = spec.extra
    if kind == "linear":
        nk, dk = int(ex.get("linear_num_key_heads") or 0), int(ex.get("linear_key_head_dim") or 0)
        nv, dv = int(ex.get("linear_num_value_heads") or 0), int(ex.get("linear_value_head_dim") or 0)
        # q, k, v, z and the b/a gates in; output projection out; conv weights.
        return h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h + (2 * nk * dk + nv * dv) * 4
    inner = int(ex.get("mamba_num_heads") or 0) * int(ex.get("mamba_head_dim") or 0)
    if not inner:
        inner = int(ex.get("mamba_expand") or 2) * h
    return h * 3 * inner + inner * h


def layer_params(spec: ModelSpec, i: int, tp: int) -> LayerParams:
    kind = spec.layer_kinds[i]
    h = spec.hidden_size
    norms = 2 * h
    pattern = spec.extra.get("hybrid_override_pattern")
    if pattern:
        # Nemotron-H: each layer is exactly one block (mixer, attention, MLP or MoE).
        c = pattern[i]
        if c == "M":
            return LayerParams(_mixer(spec, "mamba"), h)
        if c == "*":
            return LayerParams(_attention(spec, tp).split, h)
        if c == "E" and spec.moe is not None:
            return LayerParams(_moe_params(spec), h, _expert_params(spec))
        return LayerParams(2 * h * spec.intermediate_size, h)  # non-gated MLP
    attn = (
        _attention(spec, tp)
        if kind in ("full", "sliding", "chunked", "mla")
        else LayerParams(_mixer(spec, kind), 0)
    )
    experts = 0
    if spec.moe is not None and i not in spec.moe.dense_layers:
        mlp, experts = _moe_params(spec), _expert_params(spec)
    else:
        mlp = 3 * h * spec.intermediate_size  # gated MLP: gate, up, down
    return LayerParams(attn.split + mlp, attn.replicated + norms, experts)


def _expert_params(spec: ModelSpec) -> int:
    m = spec.moe
    return m.num_experts * 3 * spec.hidden_size * m.expert_intermediate


def _moe_params(spec: ModelSpec) -> int:
    m, h = spec.moe, spec.hidden_size
    return _expert_params(spec) + h * m.num_experts + 3 * h * m.shared_intermediate


@dataclass(frozen=True)
class WeightsEstimate:
    params: int
    total_bytes: int
    per_gpu_bytes: int


def estimate_weights(spec: ModelSpec, fmt: WeightFormat, tp: int = 1, pp: int = 1) -> WeightsEstimate:
    """Total bytes of one copy, and bytes on the most loaded GPU."""
    h = spec.hidden_size
    embed = spec.vocab_size * h
    head = 0 if spec.tie_embeddings else embed
    rope_cache = (spec.max_position_embeddings or 0) * spec.head_dim  # cos/sin at 16 bit
    layers = [layer_params(spec, i, 1) for i in range(spec.num_layers)]
    params = embed + head + h + sum(lp.split + lp.replicated for lp in layers)
    lin, emb = fmt.linear_bytes, fmt.embed_bytes
    # Bytes per parameter of a layer's TP-split part (experts-only formats keep the rest 16 bit).
    dense = fmt.embed_bytes if fmt.experts_only and spec.moe is not None else lin

    mult = fmt.expert_hidden_multiple
    expert_pad = math.ceil(h / mult) * mult / h

    def split_bytes(lp: LayerParams) -> float:
        return lp.experts * lin * expert_pad + (lp.split - lp.experts) * dense

    total = int(
        sum(split_bytes(lp) + lp.replicated * 2 for lp in layers)
        + (embed + head) * emb
        + h * 2
        + rope_cache * 2
    )
    ranked = [layer_params(spec, i, tp) for i in range(spec.num_layers)]
    per_stage = []
    for s, st in enumerate(stage_layers(spec.num_layers, pp)):
        b = sum(split_bytes(ranked[i]) / tp + ranked[i].replicated * 2 for i in st) + rope_cache * 2
        if s == 0:
            b += embed * emb / tp  # vocab-parallel embedding on the first stage
        if s == pp - 1:
            b += (head if head else (embed if pp > 1 else 0)) * emb / tp + h * 2
        per_stage.append(b)
    return WeightsEstimate(params=int(params), total_bytes=total, per_gpu_bytes=int(max(per_stage)))
