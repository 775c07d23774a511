"""The descriptive parts of a plan dict: model, KV per token and per context, weights per dtype."""

from __future__ import annotations

from tierguard.plan.config import ModelSpec
from tierguard.plan.dtypes import weight_format
from tierguard.plan.inputs import PlanInputs
from tierguard.plan.kv import GROWING, KVModel
from tierguard.plan.weights import estimate_weights

COMPARED_DTYPES = ("bf16", "fp8", "int8", "int4")  # weights shown next to the checkpoint's own


def model_dict(spec: ModelSpec, params: int) -> dict:
    return {
        "name": spec.name,
        "architecture": spec.architecture,
        "family": spec.family,
        "num_layers": spec.num_layers,
        "layer_kinds": {k: spec.count(k) for k in dict.fromkeys(spec.layer_kinds)},
        "num_attention_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "sliding_window": spec.sliding_window,
        "attention_chunk_size": spec.chunk_size,
        "mla_latent": (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) if spec.mla else None,
        "params": params,
        "params_b_published": spec.params_b,
        "torch_dtype": spec.torch_dtype,
        "defaulted": dict(spec.defaulted),
    }


def kv_dict(kvm: KVModel, contexts: list[int], spec: ModelSpec) -> dict:
    fmt = kvm.s.fmt
    return {
        "dtype": fmt.name,
        "format_note": fmt.note,
        "bytes_per_token": kvm.bytes_per_token(),
        "bytes_per_token_per_gpu": kvm.bytes_per_token_per_gpu(),
        "per_sequence_bytes": {str(c): kvm.sequence_bytes(c) for c in contexts},
        "per_sequence_bytes_per_gpu": {str(c): kvm.sequence_bytes_per_gpu(c) for c in contexts},
        "kv_heads_per_rank": kvm.kv_heads_per_rank if spec.mla is None else 1,
        "replication": kvm.replication,
        "growing_layers": sum(1 for k in spec.layer_kinds if k in GROWING),
        "constant_state_bytes_per_sequence": sum(
            kvm.state_bytes(k, per_rank=False) for k in spec.layer_kinds
        ),
    }


def weights_by_dtype(p: PlanInputs, spec: ModelSpec, own: str) -> dict:
    out = {}
    for name in dict.fromkeys((own, *COMPARED_DTYPES)):
        w = estimate_weights(spec, weight_format(name, spec.torch_dtype, spec.quantization), p.tp, p.pp)
        out[name] = {"total_bytes": w.total_bytes, "per_gpu_bytes": w.per_gpu_bytes}
    return out


def settings_dict(p: PlanInputs, mml: int, mnbt: int | None, mns: int | None, hybrid: bool) -> dict:
    return {
        "tp": p.tp,
        "pp": p.pp,
        "block_size": p.block_size,
        "gpu_memory_utilization": p.gpu_memory_utilization,
        "max_num_batched_tokens": mnbt,
        "max_num_seqs": mns,
        "max_model_len": mml,
        "hybrid_allocator": hybrid,
        "target": p.target,
    }
