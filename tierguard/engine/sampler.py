"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds — one batch at a time.

All rows are filtered together; a token is drawn by inverting each row's CDF at one
uniform number (one random number per row, not per vocabulary entry). A seeded request
draws its number from its own CPU torch.Generator, so its output does not depend on its
batch neighbours or on the device.

Generators are drawn from only after every computation that depends on a row's
parameters, so a batch that raises on one row's parameters has drawn nothing: the engine
then samples row by row (to fail only the row that raises), and seeded rows still draw
the numbers they would have drawn in the batch.
"""

from __future__ import annotations

import math

import torch

from tierguard.common.errors import TierguardError
from tierguard.engine.api import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

# vLLM's floor for a non-zero temperature: below it logits / temperature overflows to
# inf and the softmax to NaN, so any token could come out. Such a row is all but greedy.
MIN_TEMPERATURE = 1e-2


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise TierguardError naming the first field out of range (the bounds in api.py)."""
    problem = _out_of_range(params, vocab_size)
    if problem is not None:
        raise TierguardError(f"sampling parameter out of range: {problem}")


def _out_of_range(p: SamplingParams, vocab: int) -> str | None:
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        return f"temperature must be a finite number >= 0, got {p.temperature}"
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k is not None and not 1 <= p.top_k <= vocab:
        return f"top_k must be in [1, {vocab}] (the vocabulary size), got {p.top_k}"
    if p.seed is not None and not SEED_MIN <= p.seed <= SEED_MAX:
        return f"seed must be within int64 [{SEED_MIN}, {SEED_MAX}], got {p.seed}"
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in p.stop):
        return f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}"
    if any(not 0 <= t < vocab for t in p.stop_token_ids):
        return f"stop_token_ids must be within the vocabulary [0, {vocab})"
    return None


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus. logits: [N, V]."""
    n, v = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=logits.device).expand(n, v)
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    drop = ranks >= k
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (probs.cumsum(-1) - probs) > p
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: float32 [N, V] on any device. Returns N token ids."""
    n, v = logits.shape
    if n == 0:
        return []
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.top_k != 1]
    if not random_rows:
        return logits.argmax(-1).tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    sub = logits.index_select(0, rows)
    temps = torch.tensor(
        [max(params[i].temperature, MIN_TEMPERATURE) for i in random_rows], device=logits.device
    ).unsqueeze(1)
    sub = sub / temps
    top_k = [min(params[i].top_k or v, v) for i in random_rows]  # k >= V keeps every token
    top_p = [params[i].top_p for i in random_rows]
    if any(k < v for k in top_k) or any(p < 1.0 for p in top_p):
        sub = _filter(sub, top_k, top_p)
    cdf = sub.softmax(-1).cumsum(-1)
    u = torch.rand(len(random_rows), 1)
    for j, i in enumerate(random_rows):
        gen = generators[i]
        if gen is not None:
            u[j] = torch.rand(1, generator=gen)
    u = u.to(cdf.device) * cdf[:, -1:]
    # First index whose CDF exceeds u; zero-probability tokens have a flat CDF, so never.
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=v - 1)
    out = logits.argmax(-1)
    out[rows] = drawn
    return out.tolist()


def make_generator(seed: int | None) -> torch.Generator | None:
    """CPU generators keep seeded output identical across devices. `seed` is an int64
    (ValueError otherwise: torch would take up to 2**64 - 1, vLLM and our API take int64)."""
    if seed is None:
        return None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be within int64 [{SEED_MIN}, {SEED_MAX}], got {seed}")
    return torch.Generator(device="cpu").manual_seed(seed)
