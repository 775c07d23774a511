"""AsyncLLMEngine: streaming to asyncio, cancellation frees blocks, errors reach callers."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.conftest import make_engine, prompt_ids
from tierguard.common.errors import TierguardError
from tierguard.engine.api import SamplingParams
from tierguard.engine.async_engine import AsyncLLMEngine


async def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.stats().kv_blocks_used or engine.stats().num_running or engine.stats().num_waiting:
        if loop.time() > deadline:
            raise AssertionError(f"engine not idle: {engine.stats()}")
        await asyncio.sleep(0.02)


def test_concurrent_streams_cancel_and_abort(tiny_dir):
    async def main():
        engine = AsyncLLMEngine(make_engine(tiny_dir, num_blocks=256))
        await engine.start()
        try:

            async def collect(rid, n):
                outs = [
                    o
                    async for o in engine.generate(
                        rid, prompt_ids(len(rid), 12), SamplingParams(max_tokens=n, ignore_eos=True)
                    )
                ]
                return outs

            results = await asyncio.gather(*(collect(f"s{i}", 5 + i) for i in range(6)))
            for i, outs in enumerate(results):
                assert sum(len(o.new_token_ids) for o in outs) == 5 + i
                assert [o.finished for o in outs].count(True) == 1 and outs[-1].finish_reason == "length"

            # A consumer that goes away mid-stream aborts its request and frees its blocks.
            agen = engine.generate(
                "cancel-me", prompt_ids(1, 20), SamplingParams(max_tokens=200, ignore_eos=True)
            )
            first = await agen.__anext__()
            assert not first.finished
            await agen.aclose()
            await _wait_idle(engine)

            # Task cancellation does the same.
            task = asyncio.create_task(collect("cancel-task", 200))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_idle(engine)

            # abort() ends a live stream with a final "abort" output.
            seen = []

            async def consume():
                async for o in engine.generate(
                    "ab", prompt_ids(2, 8), SamplingParams(max_tokens=200, ignore_eos=True)
                ):
                    seen.append(o)
                    if len(seen) == 2:
                        await engine.abort("ab")

            await asyncio.wait_for(consume(), 20)
            assert seen[-1].finished and seen[-1].finish_reason == "abort"
            await _wait_idle(engine)
            engine.engine.check_integrity()

            with pytest.raises(TierguardError):
                async for _ in engine.generate("bad", [], SamplingParams()):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_from_model_dir_end_to_end(tiny_dir, hf_model):
    async def main():
        engine = AsyncLLMEngine.from_model_dir(
            tiny_dir,
            device="cpu",
            kv_cache_gib=0.01,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=256,
            model_name="tiny",
        )
        assert engine.model_name == "tiny" and engine.max_model_len == 256
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        ids = engine.tokenizer.encode(prompt)
        text, out_ids = "", []
        async for o in engine.generate(
            "c", ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ):
            text += o.text_delta
            out_ids += o.new_token_ids
            last = o
        assert last.num_output_tokens == 6 and last.num_prompt_tokens == len(ids)
        assert engine.stats().kv_blocks_total > 0
        await engine.shutdown()
        return ids, out_ids, text

    ids, out_ids, text = asyncio.run(main())
    # Greedy from transformers' own forward of the same weights, decoded by the `tokenizers`
    # library directly: what the stream must have carried, token for token and as text.
    import torch
    from tokenizers import Tokenizer

    hf, seq = hf_model(tiny_dir), list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    expected = seq[len(ids) :]
    assert out_ids == expected
    assert text == Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).decode(expected, skip_special_tokens=True)
    assert text.strip()  # six tokens of real text, not an empty stream


def test_from_model_dir_rejects_bad_settings(tiny_dir, tmp_path):
    with pytest.raises(TierguardError, match="config.json"):
        AsyncLLMEngine.from_model_dir(tmp_path)
    with pytest.raises(TierguardError, match="max_position_embeddings"):
        AsyncLLMEngine.from_model_dir(tiny_dir, max_model_len=10**6)
    with pytest.raises(TierguardError, match="KV budget"):
        AsyncLLMEngine.from_model_dir(tiny_dir, kv_cache_gib=1e-6)


# Run in a fresh interpreter: a pytest process has run OpenMP work on its main thread long ago.
_POOL_PROBE = """
import os, time, torch
from tierguard.engine.async_engine import on_own_thread
torch.set_num_threads(2)
def count(): return len(os.listdir('/proc/self/task'))
def omp_work(): return float(torch.ones(1 << 24).sum())  # large enough to run on 2 threads
before = count()
assert on_own_thread(omp_work) == float(1 << 24)
deadline = time.monotonic() + 10
while count() > before and time.monotonic() < deadline:
    time.sleep(0.01)
after_own = count()
omp_work()  # the same work on this (never exiting) thread keeps a pool worker
print(before, after_own, count())
"""


def test_load_thread_takes_its_openmp_pool_with_it():
    """Why from_model_dir loads on its own thread: a pool left on the main thread would put
    the engine thread's team over the CPU count, and libgomp then sleeps at every barrier."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after_own, after_main = map(int, out.stdout.split())
    assert after_own == before  # the load thread's pool left with it
    assert after_main == before + 1  # the probe sees a pool: the check above could fail


def test_from_model_dir_loads_off_the_callers_thread(tiny_dir, monkeypatch):
    import threading

    import tierguard.engine.factory as factory

    seen, real = [], factory.build_engine

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(factory, "build_engine", spy)
    engine = AsyncLLMEngine.from_model_dir(tiny_dir, kv_cache_gib=0.01, max_model_len=256)
    assert engine.max_model_len == 256
    assert seen and seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_engine_outlives_an_event_loop(tiny_dir):
    engine = AsyncLLMEngine(make_engine(tiny_dir))

    async def once(rid):
        return [
            o async for o in engine.generate(rid, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        ]

    first = asyncio.run(once("a"))  # loop closes without shutdown
    second = asyncio.run(asyncio.wait_for(once("b"), 10))
    assert first[-1].finished and second[-1].finished
    asyncio.run(engine.shutdown())
