"""The model's shape, read from a Hugging Face `config.json`.

One dataclass covers the Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 differ
only in a few switches (qkv bias, q/k RMSNorm, RoPE scaling, tied embeddings).
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
}


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
            # transformers >= 5 nests rope settings under "rope_parameters".
            rope = raw.get("rope_parameters") or {}
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
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                # Llama's attention_bias also puts a bias on o_proj; Qwen2's qkv bias does not.
                o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                sliding_window=_sliding_window(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TierguardError(f"config.json is missing or has a bad field: {exc}") from exc

    @property
    def max_exact_len(self) -> int:
        """Longest context this full-attention implementation computes exactly."""
        if self.sliding_window:
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


def _sliding_window(raw: dict) -> int | None:
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return None
    return int(window)
