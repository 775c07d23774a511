"""The model's shape, read from a Hugging Face `config.json`.

One dataclass covers the Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 differ
only in a few switches (qkv bias, q/k RMSNorm, RoPE scaling, tied embeddings). Gemma 3
adds per-layer attention kinds (`layer_types`: sliding or full), a second RoPE base for
the sliding layers and the query scale `query_pre_attn_scalar` (tierguard/model/gemma3.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tierguard.common.errors import TierguardError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
}
GEMMA3 = "Gemma3ForCausalLM"


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    # Attention is always full; a model trained with a sliding window is only exact up to
    # the window, so the engine caps max_model_len there.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3: "sliding_attention" / "full_attention" per layer, the sliding layers' RoPE
    # base, and the scalar whose inverse square root scales the queries.
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise TierguardError(
                f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            # transformers >= 5 nests rope settings under "rope_parameters" (Gemma 3: one
            # entry per attention kind).
            rope = raw.get("rope_parameters") or {}
            local_rope = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
            if isinstance(rope.get("full_attention"), dict):
                rope = rope["full_attention"]
            theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            scaling = raw.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            eos = raw.get("eos_token_id")
            eos_ids = (
                [int(e) for e in eos] if isinstance(eos, list) else ([int(eos)] if eos is not None else [])
            )
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == GEMMA3)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                # Llama's attention_bias also puts a bias on o_proj; Qwen2's qkv bias does not.
                o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                sliding_window=_sliding_window(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **(_gemma3(raw, local_rope) if arch == GEMMA3 else {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TierguardError(f"config.json is missing or has a bad field: {exc}") from exc

    @property
    def is_gemma3(self) -> bool:
        return self.architecture == GEMMA3

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention). Only models whose sliding
        layers are implemented as such (Gemma 3) report windows; others attend fully."""
        if not self.is_gemma3 or not self.sliding_window or self.layer_types is None:
            return [None] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @property
    def max_exact_len(self) -> int:
        """Longest context this implementation computes exactly: a model whose sliding
        window is not implemented (attention is full) is exact only up to the window."""
        if self.sliding_window and not self.is_gemma3:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise TierguardError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise TierguardError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """Elements of K+V per token across all layers (multiply by itemsize)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _gemma3(raw: dict, local_rope: dict | None) -> dict:
    """Gemma 3's extra fields; features it does not use (soft-capping) are refused."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise TierguardError(f"Gemma 3 config sets {key}={raw[key]!r}, which tierguard does not implement")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise TierguardError(f"Gemma 3 config has activation {act!r}; tierguard implements gelu_pytorch_tanh")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise TierguardError(f"Gemma 3 config: layer_types must list {layers} full/sliding_attention entries")
    local = (local_rope or {}).get("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    return {
        "layer_types": list(types),
        "rope_local_theta": float(local),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256),
    }


def _sliding_window(raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return None
    return int(window)
