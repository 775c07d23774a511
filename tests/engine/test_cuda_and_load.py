"""CUDA parity (skipped without a GPU) and a heavier async load test (slow)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tests.engine.conftest import hf_step_logits, prompt_ids
from tierguard.engine.api import SamplingParams
from tierguard.engine.async_engine import AsyncLLMEngine
from tierguard.engine.factory import build_engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_transformers_on_cpu(tiny_dir, hf_model):
    engine = build_engine(
        tiny_dir, dtype="float32", device="cuda", kv_cache_gib=0.01, block_size=16, max_model_len=256
    )
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logits_hook = lambda ids, lg: [
        logits.setdefault(r, []).append(lg[j].cpu()) for j, r in enumerate(ids)
    ]
    prompts = [prompt_ids(i, 10 + 13 * i) for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        ref = hf_step_logits(hf_model(tiny_dir), p, o)
        assert (torch.stack(logits[f"gen-0-{i}"]) - ref).abs().max().item() < 1e-3
    engine.check_integrity()


@pytest.mark.slow
def test_many_streams_with_cancellations_leave_no_blocks(tiny_dir):
    async def main():
        engine = AsyncLLMEngine.from_model_dir(
            tiny_dir,
            device="cpu",
            kv_cache_gib=0.0005,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=256,
        )
        rng = random.Random(1)

        async def client(i: int):
            n = rng.randint(1, 60)
            params = SamplingParams(max_tokens=n, temperature=0.9, seed=i, ignore_eos=True)
            got = 0
            async for out in engine.generate(f"c{i}", prompt_ids(i, rng.randint(1, 120)), params):
                got += len(out.new_token_ids)
                if i % 5 == 0 and got >= 3:
                    return None  # consumer leaves early: generate's finally aborts
            return got == n

        results = await asyncio.gather(*(client(i) for i in range(48)))
        for _ in range(200):
            if engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        stats = engine.stats()
        engine.engine.check_integrity()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    assert all(r is not False for r in results)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_block_evictions > 0  # the pool was under pressure
