"""Weights from the architecture, the GPU decomposition, and agreement with vLLM startup logs."""

from __future__ import annotations

import pytest

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan import PlanInputs, make_plan, parse_config
from tierguard.plan.catalogue import builtin_configs, load_model
from tierguard.plan.dtypes import weight_format
from tierguard.plan.gpu import GPU_CATALOGUE, find_gpu
from tierguard.plan.weights import estimate_weights

from .conftest import QWEN2_7B, llama_like


@pytest.mark.parametrize("name", sorted(builtin_configs()))
def test_parameter_count_matches_published(name):
    spec = load_model(name)
    w = estimate_weights(spec, weight_format("auto", spec.torch_dtype))
    assert w.params / 1e9 == pytest.approx(spec.params_b, rel=0.02)


def test_tied_embeddings_drop_the_lm_head():
    untied = estimate_weights(parse_config(llama_like(), "a"), weight_format("bf16"))
    tied = estimate_weights(parse_config(llama_like(tie_word_embeddings=True), "b"), weight_format("bf16"))
    assert untied.params - tied.params == 128256 * 4096


def test_weight_dtype_scales_linear_layers_only():
    spec = parse_config(llama_like(), "a")
    bf16 = estimate_weights(spec, weight_format("bf16")).total_bytes
    fp8 = estimate_weights(spec, weight_format("fp8")).total_bytes
    embeddings = 2 * 128256 * 4096 * 2
    assert fp8 < bf16 and (bf16 - embeddings) / (fp8 - embeddings) == pytest.approx(2.0, rel=0.01)


def test_catalogue_has_required_gpus_and_refuses_unknown():
    for name in ["H100-80GB", "H200-141GB", "A100-40GB", "A100-80GB", "L40S", "L4", "RTX-4090", "RTX-3090"]:
        assert name in GPU_CATALOGUE
    assert find_gpu("rtx4090").name == "RTX-4090"
    assert find_gpu(None, 24.0).total_bytes == 24 * GIB
    with pytest.raises(TierguardError, match="unknown GPU 'TPU-v5'"):
        find_gpu("TPU-v5")


def test_decomposition_adds_up():
    p = make_plan(PlanInputs(model="meta-llama/Llama-3.1-8B", gpu="L40S", host_ram_gib=64))
    g = p["gpu"]
    parts = (
        g["weights_bytes_per_gpu"]
        + g["activation_peak_bytes"]
        + g["non_torch_bytes"]
        + g["fragmentation_reserve_bytes"]
        + (g["cuda_graph_bytes"] if g["cuda_graph_in_budget"] else 0)
        + g["kv_available_bytes_per_gpu"]
    )
    assert g["cuda_graph_in_budget"]  # the newest vLLM rules subtract the CUDA-graph estimate
    assert parts == g["budget_bytes"]
    assert g["budget_bytes"] + g["headroom_bytes"] == g["total_bytes"]


def test_larger_batched_tokens_leave_less_kv():
    small = make_plan(
        PlanInputs(model="Qwen/Qwen3-8B", gpu="L40S", max_num_batched_tokens=2048, host_ram_gib=64)
    )
    big = make_plan(
        PlanInputs(model="Qwen/Qwen3-8B", gpu="L40S", max_num_batched_tokens=32768, host_ram_gib=64)
    )
    assert big["gpu"]["kv_available_bytes_per_gpu"] < small["gpu"]["kv_available_bytes_per_gpu"]


# Public vLLM startup logs: (model config, GPU total GiB, settings, logged "GPU KV cache size").
VLLM_LOGS = [
    # Qwen2-7B-Instruct bf16, one A100-80GB, gpu_memory_utilization 0.5, max_model_len 16384.
    (QWEN2_7B, "A100-80GB", None, dict(gpu_memory_utilization=0.5, max_model_len=16384), 464_848),
    # Llama-3.1-8B-Instruct bf16, one 80 GB GPU (total 79.11 GiB), 0.9, max_num_batched_tokens 8192.
    (llama_like(), None, 79.11, dict(gpu_memory_utilization=0.9, max_model_len=131072), 447_088),
]


@pytest.mark.parametrize("raw,gpu,gib,settings,logged", VLLM_LOGS)
def test_kv_capacity_within_10_percent_of_vllm_logs(raw, gpu, gib, settings, logged):
    spec = parse_config(raw, "logged")
    p = make_plan(
        PlanInputs(
            model=spec,
            gpu=gpu,
            gpu_mem_gib=gib,
            contexts=[settings["max_model_len"]],
            host_ram_gib=64,
            **settings,
        )
    )
    assert p["gpu"]["kv_capacity_tokens"] == pytest.approx(logged, rel=0.10)
