"""Config builders: small HF-style configs made from the reference values."""

from __future__ import annotations

import pytest


def llama_like(**over) -> dict:
    """The article's model: 32 layers, 8 KV heads, head_dim 128 (hidden 4096 / 32 heads)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}


@pytest.fixture
def cfg():
    return llama_like
