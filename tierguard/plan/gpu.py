"""GPU catalogue and the whole-GPU memory decomposition (R2), the way vLLM sizes its KV pool.

    total  ──┬── budget = total × gpu_memory_utilization ──┬── weights (per GPU)
             │                                             ├── activation peak (profile run)
             │                                             ├── non-torch (cuBLAS, NCCL, ...)
             │                                             ├── fragmentation reserve
             │                                             ├── CUDA graphs (vLLM >= 0.21)
             │                                             └── KV cache  (what remains)
             └── headroom = total − budget: CUDA graphs (older vLLM: captured after the KV
                 pool is sized), other processes, allocator slack

For vLLM the reserves follow the version band's rules and coefficients fitted to public
startup logs (plan/reserves.py, plan/fit.py). Other engines keep the fixed model below:
the profile forward over max_num_batched_tokens keeps ~3 MLP-intermediate and ~3
hidden-size rows per token alive at 16 bit; the sampler dummy run over max_num_seqs rows
of full-vocabulary logits peaks at ~40 bytes per logit. The peak is the larger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB, MIB
from tierguard.plan.config import ModelSpec
from tierguard.plan.reserves import Reserves, features


@dataclass(frozen=True)
class GPU:
    name: str
    total_bytes: int  # as CUDA reports it (cudaMemGetInfo total), not the marketing size
    source: str = ""  # where the total was read


def _g(gib: float) -> int:
    return int(gib * GIB)


# Totals as torch / vLLM logs print them ("total_gpu_memory (79.15GiB)"): an "80 GB" card
# reports ~79.2 GiB. Where a startup log in data/vllm_logs.json prints the total, it is named.
_LOGGED = "vLLM startup log in data/vllm_logs.json"
GPU_CATALOGUE: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU("H100-80GB", _g(79.19), f"{_LOGGED}: 75.23 GiB requested at 0.95 (0.19.0); 79.18-79.25 elsewhere"),
        GPU("H200-141GB", _g(139.80), "total_gpu_memory=139.80GiB in a public vLLM 0.6.4 log"),
        GPU("B200-180GB", _g(178.35)),
        GPU("A100-40GB", _g(39.39), f"{_LOGGED}: total_gpu_memory (39.39GiB), 0.7.1"),
        GPU("A100-80GB", _g(79.15)),
        GPU("L40S", _g(44.42)),
        GPU("L4", _g(22.03)),
        GPU("A10G", _g(22.06)),
        GPU("RTX-A6000", _g(47.43)),
        GPU("RTX-4090", _g(23.65)),
        GPU("RTX-3090", _g(23.58), f"{_LOGGED}: total_gpu_memory=23.58GiB, 0.6.4"),
    ]
}


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def find_gpu(name: str | None, mem_gib: float | None = None) -> GPU:
    """`--gpu NAME` from the catalogue, or `--gpu-mem-gib` for anything else."""
    if mem_gib is not None:
        if mem_gib <= 0:
            raise TierguardError(f"--gpu-mem-gib must be positive, got {mem_gib}")
        return GPU(name or f"custom-{mem_gib:g}GiB", _g(mem_gib))
    if not name:
        raise TierguardError("give --gpu NAME (" + ", ".join(GPU_CATALOGUE) + ") or --gpu-mem-gib")
    key = _norm(name)
    exact = [g for n, g in GPU_CATALOGUE.items() if _norm(n) == key]
    prefix = [g for n, g in GPU_CATALOGUE.items() if _norm(n).startswith(key)]
    hits = exact or prefix
    if len(hits) == 1:
        return hits[0]
    known = ", ".join(GPU_CATALOGUE)
    if len(hits) > 1:
        raise TierguardError(f"GPU {name!r} is ambiguous: say one of {', '.join(g.name for g in hits)}")
    raise TierguardError(f"unknown GPU {name!r}: choose one of {known}, or give --gpu-mem-gib")


def activation_peak_bytes(
    spec: ModelSpec, tp: int, batched_tokens: int, max_num_seqs: int, engine: str = "vllm"
) -> int:
    """Peak temporary memory of the engine's profile run (see module docstring)."""
    h = spec.hidden_size
    widths = []
    if spec.moe is None or spec.moe.dense_layers:
        widths.append(spec.intermediate_size)
    if spec.moe is not None:
        widths.append(spec.moe.experts_per_tok * spec.moe.expert_intermediate + spec.moe.shared_intermediate)
    mlp = 3 * max(widths) / tp
    attn = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim / tp
    if engine == "llamacpp":
        ubatch = min(batched_tokens, 512)  # llama.cpp computes in micro-batches of -ub 512
        return int(ubatch * (max(mlp, attn) + 3 * h) * 4 + ubatch * spec.vocab_size * 4)
    forward = batched_tokens * (max(mlp, attn) + 3 * h) * 2
    sampler = max_num_seqs * spec.vocab_size * 40
    return int(max(forward, sampler))


def non_torch_bytes(tp: int, pp: int, engine: str) -> int:
    """CUDA libraries' workspaces; collective buffers when more than one GPU talks."""
    if engine == "llamacpp":
        return 256 * MIB
    return int(0.3 * GIB) + (int(0.4 * GIB) if tp * pp > 1 else 0)


def cuda_graph_bytes(layers_per_gpu: int, engine: str) -> int:
    if engine == "llamacpp":
        return 0
    return 64 * MIB + 16 * MIB * layers_per_gpu


@dataclass
class Decomposition:
    """GPU memory of one GPU; all values are bytes on that GPU."""

    name: str
    total_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    weights_bytes_per_gpu: int
    activation_peak_bytes: int
    non_torch_bytes: int
    fragmentation_reserve_bytes: int
    cuda_graph_bytes: int
    cuda_graph_in_budget: bool
    kv_available_bytes_per_gpu: int  # never negative; see shortfall_bytes
    shortfall_bytes: int  # > 0 when weights and overheads alone exceed the budget
    headroom_bytes: int  # total − budget

    def as_dict(self) -> dict:
        return asdict(self)


def decompose(
    gpu: GPU,
    spec: ModelSpec,
    weights_per_gpu: int,
    *,
    tp: int,
    pp: int,
    gmu: float,
    batched_tokens: int,
    max_num_seqs: int,
    engine: str,
    cuda_graph_in_budget: bool = False,
    fragmentation_fraction: float | None = None,
    reserves: Reserves | None = None,
    act_bytes: int = 2,
) -> Decomposition:
    """Split one GPU's memory. With `reserves` (vLLM) the fitted, version-aware model is used."""
    budget = int(gpu.total_bytes * gmu)
    if reserves is not None:
        f = features(spec, tp, pp, batched_tokens, max_num_seqs, act_bytes)
        act, nt, graphs = reserves.activation(f), reserves.non_torch(tp), reserves.cuda_graphs(f)
    else:
        act = activation_peak_bytes(spec, tp, batched_tokens, max_num_seqs, engine)
        nt = non_torch_bytes(tp, pp, engine)
        graphs = cuda_graph_bytes(-(-spec.num_layers // pp), engine)
    if fragmentation_fraction is None:
        # vLLM/SGLang keep no explicit reserve (the headroom absorbs it); our engine keeps 2%.
        fragmentation_fraction = 0.02 if engine == "tierguard" else 0.0
    frag = int(budget * fragmentation_fraction)
    rest = budget - weights_per_gpu - act - nt - frag - (graphs if cuda_graph_in_budget else 0)
    return Decomposition(
        name=gpu.name,
        total_bytes=gpu.total_bytes,
        gpu_memory_utilization=gmu,
        budget_bytes=budget,
        weights_bytes_per_gpu=weights_per_gpu,
        activation_peak_bytes=act,
        non_torch_bytes=nt,
        fragmentation_reserve_bytes=frag,
        cuda_graph_bytes=graphs,
        cuda_graph_in_budget=cuda_graph_in_budget,
        kv_available_bytes_per_gpu=max(0, rest),
        shortfall_bytes=max(0, -rest),
        headroom_bytes=gpu.total_bytes - budget,
    )
