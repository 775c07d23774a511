"""A Hugging Face `config.json` reduced to what memory accounting needs.

Why a parser of our own: calculators go wrong exactly here (GQA ignored, explicit
`head_dim` ignored, sliding layers counted as full, MLA counted as full heads,
constant-state layers counted as attention). Every layer gets an explicit kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.plan.defaults import fill_defaults
from tierguard.plan.layers import resolve_layer_kinds
from tierguard.plan.states import constant_state_elems


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one latent of kv_lora_rank + qk_rope_head_dim."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_tok: int
    expert_intermediate: int
    shared_intermediate: int  # total width of always-on shared experts (0 if none)
    dense_layers: frozenset[int]  # layers that keep a dense MLP


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts; layer i has kind `layer_kinds[i]`.

    Kinds: "full", "sliding", "chunked", "mla" (grow with context or are capped),
    "mamba", "linear" (constant state per sequence), "none" (no cache, e.g. an MLP-only
    layer of a hybrid pattern).
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    max_position_embeddings: int | None
    torch_dtype: str
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    chunk_size: int | None = None
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    # Elements of constant state per sequence per layer (conv, recurrent) by kind.
    state_elems: dict[str, tuple[int, int]] = field(default_factory=dict)
    state_dtype: str | None = None
    qkv_bias: bool = False
    quantization: dict | None = None
    params_b: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    family: str | None = None  # transformers family whose defaults apply (plan/defaults.py)
    defaulted: dict[str, Any] = field(default_factory=dict)  # fields the config lacked, as filled
    rope_theta: float | None = None

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)


def _req(cfg: dict, key: str, name: str) -> Any:
    value = cfg.get(key)
    if value is None:
        raise TierguardError(f"model config {name!r} lacks required field {key!r}")
    return value


def _pos_int(cfg: dict, key: str, name: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise TierguardError(f"model config {name!r} lacks required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise TierguardError(
            f"model config {name!r}: field {key!r} must be a positive integer, got {value!r}"
        )
    return int(value)


def text_fields(raw: dict) -> dict:
    """Multimodal configs keep the language model under `text_config`; merge it over the top."""
    text = raw.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in raw.items() if k != "text_config"}
        merged.update(text)
        return merged
    return dict(raw)


def _moe(cfg: dict, name: str, num_layers: int, intermediate: int) -> MoESpec | None:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if not experts:
        return None
    per_tok = _pos_int(cfg, "num_experts_per_tok", name)
    width = int(cfg.get("moe_intermediate_size") or intermediate)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * width
    dense: set[int] = set(range(int(cfg.get("first_k_dense_replace") or 0)))
    dense |= {int(i) for i in (cfg.get("mlp_only_layers") or [])}
    step = int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or 1)
    if step > 1:
        dense |= {i for i in range(num_layers) if (i + 1) % step != 0}
    return MoESpec(int(experts), per_tok, width, shared, frozenset(dense))


def parse_config(raw: dict, name: str = "model") -> ModelSpec:
    """Turn a config.json dict into a ModelSpec, or raise one clear TierguardError."""
    if not isinstance(raw, dict):
        raise TierguardError(f"model config {name!r} is not a JSON object")
    cfg, defaulted, family = fill_defaults(text_fields(raw))
    arch_list = cfg.get("architectures") or [cfg.get("model_type") or "unknown"]
    arch = str(arch_list[0])
    num_layers = _pos_int(cfg, "num_hidden_layers", name)
    hidden = _pos_int(cfg, "hidden_size", name)
    heads = _pos_int(cfg, "num_attention_heads", name)
    kv_heads = _pos_int(cfg, "num_key_value_heads", name, default=heads)  # absent means MHA
    head_dim = _pos_int(cfg, "head_dim", name) if cfg.get("head_dim") else hidden // heads
    if not cfg.get("head_dim") and hidden % heads:
        raise TierguardError(
            f"model config {name!r}: hidden_size {hidden} is not divisible by "
            f"num_attention_heads {heads} and no head_dim is given"
        )
    vocab = _pos_int(cfg, "vocab_size", name)
    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None:
        max_pos = _pos_int(cfg, "max_position_embeddings", name)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLASpec(
            kv_lora_rank=_pos_int(cfg, "kv_lora_rank", name),
            qk_rope_head_dim=_pos_int(cfg, "qk_rope_head_dim", name),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or head_dim),
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        )
    kinds, window, chunk = resolve_layer_kinds(cfg, name, num_layers, is_mla=mla is not None)
    intermediate = int(cfg.get("intermediate_size") or 0)
    moe = _moe(cfg, name, num_layers, intermediate)
    if not intermediate and (moe is None or moe.dense_layers):
        _req(cfg, "intermediate_size", name)
    arch_l = arch.lower()
    tie_default = arch_l.startswith("gemma")
    states = {
        kind: constant_state_elems(cfg, name, kind, hidden) for kind in ("mamba", "linear") if kind in kinds
    }
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelSpec(
        name=name,
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
        max_position_embeddings=max_pos,
        torch_dtype=dtype,
        layer_kinds=tuple(kinds),
        sliding_window=window,
        chunk_size=chunk,
        mla=mla,
        moe=moe,
        state_elems=states,
        state_dtype=cfg.get("mamba_ssm_cache_dtype"),
        qkv_bias=bool(cfg.get("attention_bias") or cfg.get("qkv_bias") or arch_l.startswith("qwen2")),
        quantization=cfg.get("quantization_config")
        if isinstance(cfg.get("quantization_config"), dict)
        else None,
        params_b=cfg.get("params_b"),
        family=family,
        defaulted=defaulted,
        rope_theta=float(cfg["rope_theta"]) if isinstance(cfg.get("rope_theta"), (int, float)) else None,
        extra={
            k: cfg[k]
            for k in (
                "hybrid_override_pattern",
                "mamba_num_heads",
                "mamba_head_dim",
                "mamba_expand",
                "linear_num_key_heads",
                "linear_key_head_dim",
                "linear_num_value_heads",
                "linear_value_head_dim",
            )
            if k in cfg
        },
    )
