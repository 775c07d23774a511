"""TP splitting and replication, PP stages, and every KV dtype's element size."""

from __future__ import annotations

import pytest

from tierguard.common.errors import TierguardError
from tierguard.plan import PlanInputs, make_plan, parse_config
from tierguard.plan.dtypes import KV_FORMATS, kv_format
from tierguard.plan.kv import KVModel, KVSettings

from .conftest import llama_like


def kvm(raw: dict, dtype: str = "fp16", tp: int = 1, pp: int = 1) -> KVModel:
    spec = parse_config(raw, "t")
    return KVModel(
        spec, KVSettings(fmt=kv_format(dtype, spec.torch_dtype), max_model_len=32768, tp=tp, pp=pp)
    )


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_splits_kv_heads_evenly(tp):
    m = kvm(llama_like(), tp=tp)
    assert m.kv_heads_per_rank == 8 // tp
    assert m.bytes_per_token_per_gpu() * tp == m.bytes_per_token()
    assert m.replication == 1.0


def test_tp_above_kv_heads_replicates():
    m = kvm(llama_like(num_key_value_heads=2), tp=8)
    assert m.kv_heads_per_rank == 1
    assert m.replication == 4.0  # 8 ranks x 1 head over 2 logical heads
    assert m.bytes_per_token_per_gpu() == m.bytes_per_token() // 2


def test_mla_latent_replicated_on_every_rank():
    raw = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 4096,
        "vocab_size": 1000,
        "max_position_embeddings": 8192,
    }
    one, four = kvm(raw, "bf16", tp=1), kvm(raw, "bf16", tp=4)
    assert four.bytes_per_token_per_gpu() == one.bytes_per_token_per_gpu() == 4 * 576 * 2
    assert four.replication == 4.0


def test_pp_worst_stage_decides():
    m = kvm(llama_like(num_hidden_layers=30), pp=4)  # stages of 7, 7, 8, 8 layers
    per_layer = 8 * 128 * 2 * 2
    assert m.bytes_per_token_per_gpu() == 8 * per_layer


def test_tp_and_pp_split_weights_per_gpu():
    base = make_plan(PlanInputs(model="meta-llama/Llama-3.1-70B", gpu="H100-80GB", host_ram_gib=512))
    tp4 = make_plan(PlanInputs(model="meta-llama/Llama-3.1-70B", gpu="H100-80GB", tp=4, host_ram_gib=512))
    assert base["weights_bytes"] == tp4["weights_bytes"]
    assert tp4["weights_bytes_per_gpu"] == pytest.approx(base["weights_bytes_per_gpu"] / 4, rel=0.01)
    assert tp4["kv"]["bytes_per_token_per_gpu"] * 4 == tp4["kv"]["bytes_per_token"]


def test_tp_must_divide_attention_heads():
    with pytest.raises(TierguardError, match="--tp 3"):
        make_plan(PlanInputs(model="meta-llama/Llama-3.1-8B", gpu="H100-80GB", tp=3, host_ram_gib=64))


# (dtype, bytes per token per layer for 8 KV heads x head_dim 128, K and V)
ELEMS = 8 * 128
CASES = [
    ("fp32", 2 * ELEMS * 4),
    ("fp16", 2 * ELEMS * 2),
    ("bf16", 2 * ELEMS * 2),
    ("fp8", 2 * ELEMS),
    ("fp8_e4m3", 2 * ELEMS),
    ("fp8_e5m2", 2 * ELEMS),
    ("int8", 2 * ELEMS + 2 * 8 * 4),  # 4-byte scale per KV head per token for K and V
    ("fp8_per_token", 2 * ELEMS + 2 * 8 * 4),
    ("fp4_e2m1", 2 * ELEMS // 16 * 9),
    ("f32", 2 * ELEMS * 4),
    ("f16", 2 * ELEMS * 2),
    ("q8_0", 2 * ELEMS // 32 * 34),
    ("q5_1", 2 * ELEMS // 32 * 24),
    ("q5_0", 2 * ELEMS // 32 * 22),
    ("q4_1", 2 * ELEMS // 32 * 20),
    ("q4_0", 2 * ELEMS // 32 * 18),
    ("iq4_nl", 2 * ELEMS // 32 * 18),
]


def test_every_kv_dtype_is_covered():
    assert {c[0] for c in CASES} == set(KV_FORMATS)


@pytest.mark.parametrize("dtype,per_layer", CASES)
def test_kv_dtype_element_size_with_metadata(dtype, per_layer):
    assert kvm(llama_like(), dtype).bytes_per_token() == 32 * per_layer


def test_auto_follows_model_dtype_and_unknown_dtype_is_refused():
    assert kvm(llama_like(torch_dtype="float16"), "auto").s.fmt.name == "fp16"
    assert kv_format("auto", "float32").name == "bf16"
    with pytest.raises(TierguardError, match="unknown KV dtype 'fp7'"):
        kv_format("fp7")


def test_llamacpp_block_rows_round_up():
    # 8 heads x 100 = 800 values per token: 25 blocks of 32.
    m = kvm(llama_like(head_dim=100), "q4_0")
    assert m.bytes_per_token() == 32 * 2 * 25 * 18
