"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds — one batch at a time.

All rows are filtered together; a token is drawn by inverting each row's CDF at one
uniform number (one random number per row, not per vocabulary entry). A seeded request
draws its number from its own CPU torch.Generator, so its output does not depend on its
batch neighbours or on the device.
"""

from __future__ import annotations

import torch

from tierguard.engine.api import SamplingParams


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
    temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device).unsqueeze(1)
    sub = sub / temps
    top_k = [params[i].top_k or v for i in random_rows]
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
    """CPU generators keep seeded output identical across devices."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(seed)
