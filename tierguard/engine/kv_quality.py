"""How much a quantized KV pool changes what the model generates (R7: check before use).

Drives a `ModelRunner` directly with one sequence (no scheduler), so the same model can
be run over pools of different `kv_dtype` with identical chunking:

- free-running greedy: each pool generates its own continuation; agreement is the share
  of equal positions and the first divergence (`tierguard.kv.quant.token_agreement`).
  After a divergence the contexts differ, so this understates quality on models with
  near-tied logits (random-weight tiny models have top-2 margins of ~0.01-0.5).
- teacher-forced: the candidate pool is fed the reference's tokens, and its greedy
  choice is compared at every position; it measures the per-step effect of quantization
  without compounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierguard.engine.api import SamplingParams
from tierguard.engine.model_runner import ModelRunner
from tierguard.engine.scheduler import ScheduledSeq
from tierguard.engine.sequence import Sequence
from tierguard.kv.quant import token_agreement
from tierguard.model.config import ModelConfig
from tierguard.model.llama import LlamaModel


@dataclass
class GreedyTrace:
    tokens: list[int]  # greedy choice at each step
    logits: torch.Tensor  # [steps, vocab] float32


def greedy_trace(
    runner: ModelRunner,
    prompt: list[int],
    steps: int,
    forced: list[int] | None = None,
    chunk: int = 64,
) -> GreedyTrace:
    """Prefill `prompt` in chunks, then decode `steps` tokens; feed `forced` when given."""
    bs = runner.block_size
    seq = Sequence("kv-quality", prompt, SamplingParams(max_tokens=steps, temperature=0.0), 0.0)
    per_group = -(-(len(prompt) + steps) // bs)
    # Each layer group gets its own run of blocks (nothing is freed: windows are masked).
    seq.block_tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(runner.groups.num_groups)]
    if per_group * runner.groups.num_groups > runner.kv_cache.shape[0]:
        raise ValueError("the runner's pool is too small for prompt + steps")
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    while len(tokens) < steps:
        n = min(chunk, len(seq) - seq.num_computed_tokens)
        item = ScheduledSeq(seq, n)
        logits = runner.run([item])
        seq.num_computed_tokens += n
        if item.samples:
            rows.append(logits[0])
            tokens.append(int(logits[0].argmax()))
            seq.append_token(forced[len(tokens) - 1] if forced is not None else tokens[-1])
    return GreedyTrace(tokens, torch.stack(rows))


def _num_groups(model: LlamaModel) -> int:
    """KV layer groups the model's pool has (tierguard/kv/groups.py)."""
    groups = getattr(model, "groups", None)
    return groups.num_groups if groups is not None else 1


@dataclass
class Agreement:
    kv_dtype: str
    free_running: float  # share of equal positions, free-running greedy
    first_divergence: int | None
    teacher_forced: float  # share of positions with the same greedy choice, fed the reference
    max_logit_diff: float  # teacher-forced, vs the reference
    mean_logit_diff: float


def agreement(
    model: LlamaModel,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    prompt: list[int],
    steps: int,
    kv_dtypes: tuple[str, ...] = ("int8", "fp8"),
    block_size: int = 16,
    reference_kv_dtype: str = "auto",
) -> list[Agreement]:
    """Agreement of each `kv_dtypes` pool with the `reference_kv_dtype` pool, same model."""
    num_blocks = -(-(len(prompt) + steps) // block_size) * _num_groups(model)

    def runner(kv_dtype: str) -> ModelRunner:
        return ModelRunner(model, cfg, num_blocks, block_size, dtype, device, kv_dtype=kv_dtype)

    ref = greedy_trace(runner(reference_kv_dtype), prompt, steps)
    out = []
    for kv_dtype in kv_dtypes:
        free = greedy_trace(runner(kv_dtype), prompt, steps)
        forced = greedy_trace(runner(kv_dtype), prompt, steps, forced=ref.tokens)
        share, first = token_agreement(ref.tokens, free.tokens)
        same = sum(a == b for a, b in zip(ref.tokens, forced.tokens, strict=True)) / steps
        diff = (forced.logits - ref.logits).abs()
        out.append(Agreement(kv_dtype, share, first, same, float(diff.max()), float(diff.mean())))
    return out


@dataclass
class LayerAttentionError:
    layer: int
    max_abs: float
    mean_abs: float
    ref_mean_abs: float  # mean |attention output| of the reference, to read the error against


def attention_output_error(
    model: LlamaModel,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    prompt: list[int],
    kv_dtype: str,
    block_size: int = 16,
    chunk: int = 512,
    reference_kv_dtype: str = "auto",
) -> list[LayerAttentionError]:
    """Per layer: |attention output| difference of one decode step after a long `prompt`.

    The decode step reads the whole context back from the pool, so every key and value
    it sees went through the candidate's quantization. Inputs are identical (the same
    forced token); from layer 1 on, the error includes what earlier layers propagated.
    """
    captured: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _m, args: captured.append(args[0][-1].clone())
        )
        for layer in model.layers
    ]
    num_blocks = -(-(len(prompt) + 2) // block_size) * _num_groups(model)
    outputs = {}
    try:
        for name in (reference_kv_dtype, kv_dtype):
            runner = ModelRunner(model, cfg, num_blocks, block_size, dtype, device, kv_dtype=name)
            greedy_trace(runner, prompt, 2, forced=[prompt[-1], prompt[-1]], chunk=chunk)
            outputs[name] = torch.stack(captured[-len(model.layers) :]).float()
    finally:
        for h in hooks:
            h.remove()
    ref, cand = outputs[reference_kv_dtype], outputs[kv_dtype]
    diff = (cand - ref).abs()
    return [
        LayerAttentionError(i, float(diff[i].max()), float(diff[i].mean()), float(ref[i].abs().mean()))
        for i in range(ref.shape[0])
    ]
