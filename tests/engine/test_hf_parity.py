"""The engine's greedy tokens and per-step logits equal transformers' forward (fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_step_logits, make_engine, prompt_ids
from tierguard.engine.api import SamplingParams

TOL = 1e-4


def run_and_record(engine, prompts: list[list[int]], max_tokens: int, waves: int = 1):
    """Run prompts in `waves` (later waves start after earlier ones finish: prefix hits)."""
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(ids, lg):
        for j, rid in enumerate(ids):
            logits.setdefault(rid, []).append(lg[j].clone())

    engine.logits_hook = hook
    outputs: dict[str, list[int]] = {}
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        batch = prompts[w * per_wave : (w + 1) * per_wave]
        ids = [f"w{w}-{i}" for i in range(len(batch))]
        for rid, p in zip(ids, batch, strict=True):
            engine.add_request(
                rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            )
        pending = set(ids)
        while pending:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
            engine.check_integrity()
    return outputs, logits


def assert_parity(hf, prompts, outputs, logits):
    ids = sorted(outputs, key=lambda r: (int(r[1 : r.index("-")]), int(r.split("-")[1])))
    for rid, prompt in zip(ids, prompts, strict=True):
        ref = hf_step_logits(hf, prompt, outputs[rid])
        mine = torch.stack(logits[rid])
        assert mine.shape == ref.shape
        err = (mine - ref).abs().max().item()
        assert err < TOL, f"{rid}: max logit error {err}"
        assert ref.argmax(-1).tolist() == outputs[rid], f"{rid}: greedy tokens differ from transformers"


def test_batched_chunked_prefill_and_prefix_hits(tiny_dir, hf_model):
    shared = prompt_ids(1, 21)
    prompts = [shared + prompt_ids(10 + i, 5 + 7 * i) for i in range(4)] + [prompt_ids(2, 3), shared[:9]]
    prompts += [shared + prompt_ids(10, 5), shared + prompt_ids(50, 30)]  # second wave: cache hits
    # 16-token budget forces chunked prefill mixed with decodes.
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    outputs, logits = run_and_record(engine, prompts, max_tokens=6, waves=2)
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 20, stats
    assert stats.kv_blocks_used == 0
    assert_parity(hf_model(tiny_dir), prompts, outputs, logits)


def test_parity_under_preemption(tiny_dir, hf_model):
    prompts = [prompt_ids(100 + i, 18) for i in range(4)]
    # 20 blocks of 4 tokens cannot hold 4 x (18 + 16) tokens: preemption by recompute.
    engine = make_engine(tiny_dir, num_blocks=20, max_num_batched_tokens=32)
    outputs, logits = run_and_record(engine, prompts, max_tokens=16)
    assert engine.stats().num_preemptions > 0
    assert_parity(hf_model(tiny_dir), prompts, outputs, logits)


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "mistral", "llama3-rope-tied"])
def test_parity_variants(variant, variant_dir, hf_model):
    model_dir = variant_dir(variant)
    shared = prompt_ids(7, 12, vocab=390)
    prompts = [shared + prompt_ids(20 + i, 4 + 9 * i, vocab=390) for i in range(3)] + [shared + [11, 12]]
    engine = make_engine(model_dir, max_num_batched_tokens=24)
    outputs, logits = run_and_record(engine, prompts, max_tokens=5, waves=2)
    assert_parity(hf_model(model_dir), prompts, outputs, logits)
