"""Run the engine once per KV dtype over the same inputs, reusing work where it is exact.

One engine per KV dtype (the unquantized baseline first), built by `build_engine`, all
kept alive so the check can go context by context and save what it has after each:

1. Teacher-forced pass: the text (the longest context) as ONE request with
   max_tokens=1. The engine prefills it in chunks; a forward hook on the model's final
   norm keeps the hidden state of every position (hidden_size floats per token, not
   vocab-sized logits). Causal attention makes the first L positions of this pass
   exactly a pass over L tokens, so one pass serves every context.
2. Haystack warm-up: head + filler (the longest context), prefill only. The prefix
   cache keeps it, so each passkey trial computes only from its needle onwards.
3. Passkey trials, context by context (greedy, a few tokens each).

Logits are computed afterwards, chunk by chunk, from the kept hidden states (the lm_head
is the same for every dtype) and reduced to per-position NLL, top-1 and |logit - baseline|.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tierguard.common.units import GIB
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.kvcheck.inputs import ANSWER_TOKENS, BASELINE, Trial, answer_correct


@dataclass
class TrialResult:
    context: int
    index: int
    depth: float
    key: str
    answer: str
    correct: bool


@dataclass
class DtypeRun:
    kv_dtype: str
    hidden: torch.Tensor  # [positions, hidden] final-normed, teacher-forced
    trials: list[TrialResult] = field(default_factory=list)
    teacher_s: float = 0.0
    trials_s: float = 0.0
    lm_head: torch.Tensor | None = None  # the output projection (same for every dtype)


@dataclass
class PositionStats:
    """Per position p (predicting token p+1) of the teacher-forced text, per dtype."""

    nll: dict[str, torch.Tensor]  # float64
    top1: dict[str, torch.Tensor]  # int64
    max_logit_err: dict[str, torch.Tensor]  # float32, vs the baseline at the same position


def _model_of(engine):
    """The engine's model (where its forward hooks go)."""
    runner = getattr(engine, "runner", None)
    return getattr(runner, "model", None) or engine.model


# Tokens of passkey trials the pool holds at once: trials run in waves of this many
# tokens, so their decode steps batch (one step serves the whole wave).
TRIAL_TOKENS = 16384


def wave_size(context: int, trials: int) -> int:
    return max(1, min(trials, TRIAL_TOKENS // context))


def _pool_gib(cfg, max_len: int, block_size: int, trial_tokens: int, kv_dtype: str) -> float:
    """Room for the cached haystack, the teacher pass and one wave of trials: float32
    K/V, or 1-byte K/V plus a float32 scale per token and KV head when quantized."""
    blocks = -(-(2 * max_len + trial_tokens + 64) // block_size) + 8
    per_head = cfg.head_dim * 4 if kv_dtype == BASELINE else cfg.head_dim + 4
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * per_head
    return blocks * block_size * per_token / GIB


class DtypeSession:
    """One engine with one KV dtype; its teacher pass, haystack and trials."""

    def __init__(
        self,
        model_dir,
        kv_dtype: str,
        max_context: int,  # the engine's max_model_len
        *,
        device: str = "cpu",
        threads: int | None = None,
        chunk: int = 512,
        block_size: int = 16,
        max_wave: int = 1,  # most trials in flight at once
    ) -> None:
        from tierguard.model.config import ModelConfig

        cfg = ModelConfig.from_dir(model_dir)
        self.engine = build_engine(
            model_dir,
            dtype="float32",
            device=device,
            kv_cache_gib=_pool_gib(
                cfg, max_context, block_size, min(TRIAL_TOKENS, max_wave * max_context), kv_dtype
            ),
            block_size=block_size,
            max_num_seqs=max_wave,
            max_num_batched_tokens=chunk,
            max_model_len=max_context,
            num_threads=threads,  # None: the engine's CPU default (half the cores)
            kv_dtype=kv_dtype,
            # No stream waits on an offline check, and a step budget would cut prefill
            # chunks by measured timings: the chunking (what a chunk attends unquantized)
            # must be the same for every dtype and every run.
            target_itl_ms=0.0,
        )
        self.run = DtypeRun(kv_dtype, torch.empty(0))

    def teacher(self, ids: list[int]) -> None:
        rows: list[torch.Tensor] = []
        model = _model_of(self.engine)
        hook = model.norm.register_forward_hook(lambda _m, _a, out: rows.append(out.detach().float().cpu()))
        t0 = time.perf_counter()
        try:
            self.engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        finally:
            hook.remove()
        hidden = torch.cat(rows)
        if hidden.shape[0] != len(ids):  # one request, prefill only: one row per prompt token
            raise RuntimeError(f"teacher pass kept {hidden.shape[0]} hidden rows for {len(ids)} tokens")
        self.run.hidden = hidden
        self.run.lm_head = _lm_head(self.engine).cpu()
        self.run.teacher_s = time.perf_counter() - t0

    def warm(self, ids: list[int]) -> None:
        t0 = time.perf_counter()
        self.engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        self.run.trials_s += time.perf_counter() - t0

    def trials(self, trials: list[Trial], decode, progress=None) -> None:
        """Greedy answers, in waves that fit the pool (see TRIAL_TOKENS); each prompt's
        shared prefix comes from the prefix cache."""
        t0 = time.perf_counter()
        params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, stop=["."])
        step = wave_size(max(len(t.prompt) for t in trials), len(trials)) if trials else 1
        for w in range(0, len(trials), step):
            wave = trials[w : w + step]
            for trial, out in zip(wave, self.engine.generate([t.prompt for t in wave], params), strict=True):
                answer = decode(out)
                self.run.trials.append(
                    TrialResult(trial.context, trial.index, trial.depth, trial.key, answer, answer_correct(answer, trial.key))
                )
                if progress is not None:
                    progress(self.run.kv_dtype, trial)
        self.run.trials_s += time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()


def _lm_head(engine) -> torch.Tensor:
    model = _model_of(engine)
    return (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach().float()


@torch.inference_mode()
def position_stats(runs: dict[str, DtypeRun], targets: list[int], chunk: int = 256) -> PositionStats:
    """NLL of the next token, greedy choice and |logits - baseline| at every position."""
    base = runs[BASELINE]
    weight = base.lm_head
    n = len(targets) - 1  # the last position has no next token
    tgt = torch.tensor(targets[1:], dtype=torch.long)
    out = PositionStats(
        nll={k: torch.empty(n, dtype=torch.float64) for k in runs},
        top1={k: torch.empty(n, dtype=torch.long) for k in runs},
        max_logit_err={k: torch.zeros(n) for k in runs},
    )
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        ref = base.hidden[s:e] @ weight.t()
        for name, run in runs.items():
            logits = ref if name == BASELINE else run.hidden[s:e] @ weight.t()
            logp = torch.log_softmax(logits, dim=-1)
            out.nll[name][s:e] = -logp.gather(1, tgt[s:e, None]).squeeze(1).double()
            out.top1[name][s:e] = logits.argmax(dim=-1)
            if name != BASELINE:
                out.max_logit_err[name][s:e] = (logits - ref).abs().amax(dim=-1)
    return out
