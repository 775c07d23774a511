"""Architecture defaults, filled the way transformers fills them, and said out loud.

Users paste configs as they have them: trimmed ones, ones written by a fine-tuning
tool, a Gemma-3 `text_config` without `vocab_size`. transformers loads such a file by
taking the missing fields from the family's Config class defaults, and vLLM sizes its
cache from that loaded config, so a planner that refuses the file (or guesses) disagrees
with the engine. We apply the same class defaults for the catalogue families and return
every field we filled, so the plan can print it.

Core dimensions (num_hidden_layers, hidden_size, num_attention_heads, intermediate_size)
are never filled: a family default for those describes some other model, so a config
without them stays an error naming the field.

Values restated from transformers' `src/transformers/models/<family>/configuration_<family>.py`
(LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
Gemma2Config, Gemma3TextConfig, Phi3Config, DeepseekV3Config, GptOssConfig).
"""

from __future__ import annotations

from typing import Any

# Routine fields per family. `None` means "the class default is None" (e.g. no window).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "mistral": {
        "vocab_size": 32000,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "vocab_size": 32000,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 1e6,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "vocab_size": 151936,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "vocab_size": 151936,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "vocab_size": 151936,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    "gemma2": {
        "vocab_size": 256000,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "vocab_size": 262208,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
    "phi3": {
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "vocab_size": 129280,
        "num_key_value_heads": 128,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        "vocab_size": 201088,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 150000.0,
        "sliding_window": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
}

# model_type spellings and architecture class prefixes that name each family.
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
}
_ARCH_PREFIXES = [
    ("Qwen3MoeFor", "qwen3_moe"),
    ("Qwen3For", "qwen3"),
    ("Qwen2For", "qwen2"),
    ("LlamaFor", "llama"),
    ("MistralFor", "mistral"),
    ("MixtralFor", "mixtral"),
    ("Gemma2For", "gemma2"),
    ("Gemma3ForCausalLM", "gemma3_text"),
    ("Gemma3ForConditionalGeneration", "gemma3_text"),
    ("Phi3For", "phi3"),
    ("DeepseekV3For", "deepseek_v3"),
    ("GptOssFor", "gpt_oss"),
]


def family_of(cfg: dict) -> str | None:
    """The transformers family a (text-merged) config belongs to, or None if not a catalogue one."""
    mt = str(cfg.get("model_type") or "").lower()
    if mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt]
    for arch in cfg.get("architectures") or []:
        for prefix, fam in _ARCH_PREFIXES:
            if str(arch).startswith(prefix):
                return fam
    return None


def _layer_types(fam: str, cfg: dict) -> list[str] | None:
    """Families whose Config builds `layer_types` itself when the file has none."""
    n = cfg.get("num_hidden_layers")
    if fam == "gpt_oss" and isinstance(n, int) and n > 0:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return None


def fill_defaults(cfg: dict) -> tuple[dict, dict[str, Any], str | None]:
    """Return (config with family defaults filled, {field: value filled}, family).

    Only keys absent from the file are filled; an explicit null stays null (a config
    that says `"sliding_window": null` means no window, as transformers reads it).
    """
    fam = family_of(cfg)
    if fam is None:
        return cfg, {}, None
    out = dict(cfg)
    filled: dict[str, Any] = {}
    for key, value in FAMILY_DEFAULTS[fam].items():
        if key not in out:
            out[key] = value
            filled[key] = value
    if "layer_types" not in out:
        types = _layer_types(fam, out)
        if types is not None:
            out["layer_types"] = types
            filled["layer_types"] = "alternating sliding/full, starting sliding"
    return out, filled, fam
