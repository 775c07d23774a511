"""`--target cpu`: plan `tierguard serve` on this machine, with host RAM in the GPU's place.

    RAM total ──┬── OS + services / page cache / bursts  (plan/host.py reserves)
                └── usable ──┬── weights (fp32, bf16 or fp16; or int8/int4 quantized at load)
                             ├── activation peak (one step of max_num_batched_tokens)
                             ├── fragmentation reserve (2%)
                             └── KV pool  -> `tierguard serve --device cpu --kv-cache-gib`

The engine's own CPU default keeps the KV pool at 0.5 GiB at most (it shares RAM with
everything else); a plan that wants more says so with an explicit --kv-cache-gib.
"""

from __future__ import annotations

from tierguard.common.errors import TierguardError
from tierguard.plan.config import ModelSpec
from tierguard.plan.dtypes import WeightFormat
from tierguard.plan.gpu import Decomposition, activation_peak_bytes
from tierguard.plan.host import HostBudget

CPU_BATCHED_TOKENS = 512  # tierguard serve's default step size on CPU (engine/factory.py)
CPU_MAX_NUM_SEQS = 128  # and its default sequence limit (engine/config.py)
FLOAT_WEIGHTS = ("fp32", "bf16", "fp16")


# `tierguard serve --weight-dtype` (tierguard/model/qlinear.py): bytes per parameter of a
# linear layer and of the embedding (int8 in groups of 32 with a float16 scale, as GGUF
# Q8_0: 1 + 2/32; int4 in groups of 32 with a float16 scale and min: 0.5 + 4/32; with int4
# the embedding and lm_head stay int8).
INT8_BYTES = 1.0 + 2 / 32
SERVE_WEIGHTS = {"int8": (INT8_BYTES, INT8_BYTES), "int4": (0.5 + 4 / 32, INT8_BYTES)}


def check_cpu_weights(wfmt: WeightFormat) -> None:
    if wfmt.name not in FLOAT_WEIGHTS and wfmt.name not in SERVE_WEIGHTS:
        raise TierguardError(
            f"--target cpu: tierguard serve loads float32, bfloat16 or float16 weights, or quantizes "
            f"them to int8 or int4 at load; not {wfmt.name}"
        )


def cpu_weight_format(wfmt: WeightFormat) -> WeightFormat:
    """The bytes tierguard serve's own int8/int4 take (not the AWQ/GPTQ-style defaults)."""
    check_cpu_weights(wfmt)
    if wfmt.name not in SERVE_WEIGHTS:
        return wfmt
    linear, embed = SERVE_WEIGHTS[wfmt.name]
    return WeightFormat(wfmt.name, linear, embed)


def ram_decompose(
    host: HostBudget,
    spec: ModelSpec,
    weights_bytes: int,
    batched_tokens: int,
    max_num_seqs: int,
    act_bytes: int,
) -> Decomposition:
    budget = host.usable_bytes
    act = activation_peak_bytes(spec, 1, batched_tokens, max_num_seqs, "tierguard") * act_bytes // 2
    frag = int(budget * 0.02)
    rest = budget - weights_bytes - act - frag
    return Decomposition(
        name="host RAM (tierguard serve --device cpu)",
        total_bytes=host.total_bytes,
        gpu_memory_utilization=round(budget / host.total_bytes, 4) if host.total_bytes else 0.0,
        budget_bytes=budget,
        weights_bytes_per_gpu=weights_bytes,
        activation_peak_bytes=act,
        non_torch_bytes=0,
        fragmentation_reserve_bytes=frag,
        cuda_graph_bytes=0,
        cuda_graph_in_budget=False,
        kv_available_bytes_per_gpu=max(0, rest),
        shortfall_bytes=max(0, -rest),
        headroom_bytes=host.total_bytes - budget,
    )
