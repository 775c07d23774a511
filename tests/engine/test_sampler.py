"""Sampler: distributions follow temperature / top-k / top-p; masked tokens never drawn."""

from __future__ import annotations

import collections

import torch

from tierguard.engine.api import SamplingParams
from tierguard.engine.sampler import make_generator, sample

PROBS = [0.1, 0.2, 0.0001, 0.6999]
N = 4000


def freqs(params: SamplingParams) -> dict[int, float]:
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([PROBS] * N))
    counts = collections.Counter(sample(logits, [params] * N, [None] * N))
    return {k: v / N for k, v in counts.items()}


def test_plain_sampling_matches_probabilities():
    f = freqs(SamplingParams(temperature=1.0))
    for token, p in enumerate(PROBS):
        assert abs(f.get(token, 0.0) - p) < 0.03


def test_top_p_and_top_k_restrict_the_support():
    f = freqs(SamplingParams(temperature=1.0, top_p=0.75))  # 0.7 < 0.75, so 0.2 joins; 0.1 does not
    assert set(f) == {1, 3} and abs(f[3] - 0.7 / 0.9) < 0.03
    f = freqs(SamplingParams(temperature=1.0, top_k=2))
    assert set(f) == {1, 3}


def test_low_temperature_sharpens_and_greedy_is_argmax():
    assert freqs(SamplingParams(temperature=0.1)).get(3, 0) > 0.99
    logits = torch.randn(5, 50)
    assert sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5) == logits.argmax(-1).tolist()


def test_seeded_rows_are_reproducible():
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    a = [sample(logits[:1], params[:1], [make_generator(7)])[0] for _ in range(1)]
    gens = [make_generator(7), make_generator(7), make_generator(8)]
    b = sample(logits, params, gens)
    assert b[0] == b[1] == a[0] and b[2] != b[0]
