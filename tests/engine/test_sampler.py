"""Sampler: distributions follow temperature / top-k / top-p; masked tokens never drawn."""

from __future__ import annotations

import collections

import pytest
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


def test_a_batch_that_raises_has_drawn_nothing_from_its_generators():
    """What lets the engine retry a failed batch row by row: the seeded rows' generators are
    drawn from only after everything a row's parameters feed, so after a raise they stand
    where they stood, and the retry draws what the batch would have drawn."""
    logits = torch.zeros(2, 100)
    gen = make_generator(7)
    before = gen.get_state().clone()
    bad = SamplingParams(temperature=1.0, top_k="three")  # type: ignore[arg-type]  # what validation refuses
    with pytest.raises(TypeError):
        sample(logits, [SamplingParams(temperature=1.0, seed=7), bad], [gen, None])
    assert torch.equal(gen.get_state(), before)


def test_extreme_values_the_api_allows_sample_sanely():
    """top_k at the vocabulary size and beyond it keep every token; a temperature too small
    to divide by samples as the argmax (vLLM's 0.01 floor) instead of NaN garbage."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert sample(logits, [SamplingParams(temperature=1e-300)], [None]) == [1]
    assert sample(logits, [SamplingParams(temperature=5e-324, top_p=0.5)], [None]) == [1]
    torch.manual_seed(0)
    wide = [SamplingParams(temperature=50.0, top_k=k, top_p=0.999) for k in (4, 2**70)]
    seen = {t for _ in range(200) for t in sample(torch.cat([logits, logits]), wide, [None, None])}
    assert seen == {0, 1, 2, 3}


def test_make_generator_takes_int64_only():
    assert make_generator(-(2**63)) is not None and make_generator(2**63 - 1) is not None
    for seed in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match="int64"):
            make_generator(seed)
