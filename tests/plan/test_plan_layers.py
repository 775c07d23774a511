"""Every layer kind, with configs built from the reference values (KV_ACCOUNTING.md)."""

from __future__ import annotations

import math

import pytest

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB, KIB
from tierguard.plan import parse_config
from tierguard.plan.catalogue import load_model
from tierguard.plan.dtypes import kv_format
from tierguard.plan.kv import KVModel, KVSettings

from .conftest import llama_like


def kvm(raw: dict, dtype: str = "fp16", mml: int = 131072, tp: int = 1, pp: int = 1, **kw) -> KVModel:
    spec = parse_config(raw, "test")
    return KVModel(
        spec, KVSettings(fmt=kv_format(dtype, spec.torch_dtype), max_model_len=mml, tp=tp, pp=pp, **kw)
    )


def test_article_example_128kib_per_token_4gib_per_sequence_32gib_for_eight():
    m = kvm(llama_like())
    assert m.bytes_per_token() == 128 * KIB
    assert m.sequence_bytes(32768) == 4 * GIB
    assert 8 * m.sequence_bytes(32768) == 32 * GIB


def test_gqa_uses_kv_heads_not_attention_heads():
    gqa = kvm(llama_like(num_key_value_heads=8)).bytes_per_token()
    mha = kvm(llama_like(num_key_value_heads=None)).bytes_per_token()  # absent means MHA
    mqa = kvm(llama_like(num_key_value_heads=1)).bytes_per_token()
    assert mha == 4 * gqa == 32 * mqa
    assert mqa == 32 * 1 * 128 * 2 * 2


def test_explicit_head_dim_wins_over_hidden_over_heads():
    # Qwen3-8B style: head_dim 128 while hidden/heads = 4096/32 = 128; make them differ.
    m = kvm(llama_like(hidden_size=5120, head_dim=128, num_hidden_layers=36))
    assert m.bytes_per_token() == 36 * 8 * 128 * 2 * 2


def test_block_rounding_charges_whole_pages():
    m = kvm(llama_like(), block_size=16)
    assert m.sequence_bytes(17) == 2 * 16 * m.bytes_per_token()


def test_mla_one_latent_no_times_two_and_ignores_misleading_head_dim():
    raw = load_model("deepseek-ai/DeepSeek-V3")
    base = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "head_dim": 64,
    }
    m = kvm(base, dtype="bf16")
    assert m.bytes_per_token() == 61 * (512 + 64) * 2
    assert raw.layer_kinds == ("mla",) * 61
    # fp8_ds_mla: 656 bytes per token per layer.
    assert kvm(base, dtype="fp8_ds_mla").bytes_per_token() == 61 * 656


def test_sliding_all_layers_capped_with_extra_page():
    raw = llama_like(sliding_window=4096, max_position_embeddings=131072)
    m = kvm(raw, mml=131072, max_num_batched_tokens=2048)
    kept = 4096 - 1 + 2048
    pages = math.ceil(kept / 16) + 1
    assert m.sequence_bytes(100_000) == 32 * pages * 16 * (8 * 128 * 2 * 2)
    # Short sequences hold only what they have.
    assert m.sequence_bytes(1000) == kvm(llama_like()).sequence_bytes(1000)
    assert m.bytes_per_token() == 0  # nothing grows at long context


def test_use_sliding_window_false_means_no_sliding_layers():
    spec = parse_config(
        llama_like(sliding_window=131072, use_sliding_window=False, max_window_layers=28), "q"
    )
    assert set(spec.layer_kinds) == {"full"}
    assert spec.sliding_window is None


def test_qwen2_max_window_layers_keeps_first_layers_full():
    spec = parse_config(llama_like(sliding_window=4096, use_sliding_window=True, max_window_layers=20), "q")
    assert spec.layer_kinds[:20] == ("full",) * 20 and spec.layer_kinds[20:] == ("sliding",) * 12


def test_gemma2_alternates_starting_with_sliding():
    spec = load_model("google/gemma-2-9b")
    assert spec.layer_kinds[0] == "sliding" and spec.layer_kinds[1] == "full"
    assert spec.count("sliding") == spec.count("full") == 21


def test_gemma3_default_pattern_every_sixth_global_and_capped_sliding_layers():
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "num_hidden_layers": 62,
            "num_attention_heads": 32,
            "num_key_value_heads": 16,
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "sliding_window": 1024,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
        },
    }
    spec = parse_config(raw, "gemma3")
    assert spec.count("full") == 10 and spec.count("sliding") == 52
    assert spec.layer_kinds[5] == "full" and spec.layer_kinds[0] == "sliding"
    m = kvm(raw, mml=131072, max_num_batched_tokens=8192)
    per_layer_token = 16 * 128 * 2 * 2
    sliding_pages = math.ceil((1024 - 1 + 8192) / 16) + 1
    expected = (10 * (131072 // 16) + 52 * sliding_pages) * 16 * per_layer_token
    assert m.sequence_bytes(131072) == expected
    naive = 62 * per_layer_token * 131072  # every layer counted as full: the known calculator bug
    assert naive / expected > 4


def test_layer_types_list_and_hybrid_allocator_off():
    spec = load_model("openai/gpt-oss-20b")
    assert spec.count("sliding") == 12 and spec.count("full") == 12
    raw = {
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    on, off = kvm(raw, mml=131072), kvm(raw, mml=131072, hybrid_allocator=False)
    assert on.bytes_per_token() == 2 * 8 * 64 * 2 * 2
    assert off.bytes_per_token() == 4 * 8 * 64 * 2 * 2
    assert off.sequence_bytes(65536) > on.sequence_bytes(65536)


def test_chunked_local_attention_llama4_default_pattern():
    raw = llama_like(attention_chunk_size=8192, num_hidden_layers=48)
    spec = parse_config(raw, "llama4")
    assert spec.count("full") == 12 and spec.count("chunked") == 36  # every 4th layer is NoPE/global
    m = kvm(raw, mml=131072, max_num_batched_tokens=8192)
    per_layer_token = 8 * 128 * 2 * 2
    chunk_pages = math.ceil((8192 + 8192) / 16)  # no extra page
    full_pages = math.ceil(131072 / 16)
    assert m.sequence_bytes(131072) == (36 * chunk_pages + 12 * full_pages) * 16 * per_layer_token


def test_nemotron_h_hybrid_override_pattern_constant_mamba_state():
    raw = llama_like(
        num_hidden_layers=8,
        hybrid_override_pattern="M-M*M-M*",
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
    )
    spec = parse_config(raw, "nemotron-h")
    assert spec.count("mamba") == 4 and spec.count("full") == 2 and spec.count("none") == 2
    m = kvm(raw, dtype="bf16")
    inner = 128 * 64
    state = ((4 - 1) * (inner + 2 * 8 * 128) + 128 * 64 * 128) * 2  # bf16
    attn = 2 * 8 * 128 * 2 * 2
    assert m.bytes_per_token() == attn
    assert m.sequence_bytes(1600) == 4 * state + 1600 * attn
    # Constant: the Mamba part does not change with context.
    assert m.sequence_bytes(3200) - m.sequence_bytes(1600) == 1600 * attn


def test_qwen3_next_full_attention_interval_linear_layers():
    raw = llama_like(
        num_hidden_layers=48,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_num_value_heads=32,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )
    spec = parse_config(raw, "qwen3-next")
    assert spec.count("full") == 12 and spec.count("linear") == 36
    assert spec.layer_kinds[3] == "full"
    m = kvm(raw, dtype="bf16")
    assert m.bytes_per_token() == 12 * 2 * 256 * 2 * 2
    state = (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
    assert m.sequence_bytes(16) == 36 * state + 16 * m.bytes_per_token()


def test_jamba_attention_period_and_mamba1_state():
    raw = llama_like(
        num_hidden_layers=8,
        attn_layer_period=8,
        attn_layer_offset=4,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
    )
    spec = parse_config(raw, "jamba")
    assert spec.layer_kinds[4] == "full" and spec.count("mamba") == 7
    m = kvm(raw, dtype="bf16")
    inner = 2 * 4096
    assert m.state_bytes("mamba") == (3 * inner + inner * 16) * 2


def test_nested_text_config_is_read():
    raw = {
        "architectures": ["LlavaForConditionalGeneration"],
        "torch_dtype": "float16",
        "text_config": llama_like(),
    }
    assert kvm(raw).bytes_per_token() == 128 * KIB


def test_missing_field_names_it():
    raw = llama_like()
    del raw["num_hidden_layers"]
    with pytest.raises(TierguardError, match="num_hidden_layers"):
        parse_config(raw, "broken")
    with pytest.raises(TierguardError, match="ssm_state_size|mamba_d_state"):
        parse_config(llama_like(num_hidden_layers=2, hybrid_override_pattern="M*"), "broken")
