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


# -- failure isolation ----------------------------------------------------------------------
# Faults are injected by the tests alone (monkeypatching a function the engine calls), so a
# failure no input can cause today still shows how the engine would take it.
POISON_SEED = 4242  # the request the injected fault fails


def _run_pair(engine: AsyncLLMEngine, poisoned: SamplingParams, healthy: SamplingParams,
              poisoned_prompt: list[int] | None = None):
    """A healthy request and a poisoned one at once; (the healthy outputs, what the poisoned raised)."""

    async def collect(rid, prompt, params):
        return [o async for o in engine.generate(rid, prompt, params)]

    async def main():
        await engine.start()
        try:
            good, bad = await asyncio.wait_for(asyncio.gather(
                collect("healthy", prompt_ids(1, 12), healthy),
                collect("poisoned", poisoned_prompt or prompt_ids(2, 12), poisoned),
                return_exceptions=True), 60)
            after = await asyncio.wait_for(collect("after", prompt_ids(3, 8), SamplingParams(max_tokens=3, ignore_eos=True)), 60)
            await _wait_idle(engine)
            return good, bad, after
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _assert_isolated(engine: AsyncLLMEngine, good, bad, after, n_good: int) -> None:
    from tierguard.engine.api import RequestFailed

    assert isinstance(bad, RequestFailed), bad
    assert not isinstance(good, BaseException), good  # the neighbour was served in full
    assert sum(len(o.new_token_ids) for o in good) == n_good and good[-1].finish_reason == "length"
    assert after[-1].finished and after[-1].finish_reason == "length"  # and so is a later request
    assert engine.failure() is None
    engine.engine.check_integrity()  # the failed request's blocks went back to the pool


def test_a_request_whose_sampling_raises_fails_alone(tiny_dir, monkeypatch):
    """The batch's sampling raises on one row: the batch is sampled row by row, that row's
    request fails with RequestFailed, its neighbour (seeded) gets exactly the tokens it
    gets alone, and the engine serves on."""
    import tierguard.engine.llm_engine as llm

    real = llm.sample

    def sample(logits, params, generators):
        if any(p.seed == POISON_SEED for p in params):
            raise OverflowError("injected: this row's parameters break the sampler")
        return real(logits, params, generators)

    healthy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7)
    alone = AsyncLLMEngine(make_engine(tiny_dir))
    reference = _run_pair(alone, SamplingParams(max_tokens=8, ignore_eos=True), healthy)[0]
    monkeypatch.setattr(llm, "sample", sample)
    engine = AsyncLLMEngine(make_engine(tiny_dir))
    good, bad, after = _run_pair(engine, SamplingParams(max_tokens=8, ignore_eos=True, seed=POISON_SEED), healthy)
    _assert_isolated(engine, good, bad, after, 8)
    assert "OverflowError" in str(bad) and "sampling" in str(bad)
    assert [t for o in good for t in o.new_token_ids] == [t for o in reference for t in o.new_token_ids]


def test_a_request_whose_detokenizing_raises_fails_alone(tiny_dir):
    """The tokenizer raises on one request's ids while its token is detokenized (after
    sampling, in postprocessing): that request alone fails."""
    engine = AsyncLLMEngine(make_engine(tiny_dir))
    poisoned = [5, 6, 7, 400]  # the detokenizer decodes a prompt's tail with the first token
    real = engine.engine.tokenizer.decode

    def decode(ids, *args, **kwargs):
        if list(ids[:4]) == poisoned:
            raise RuntimeError("injected: cannot decode")
        return real(ids, *args, **kwargs)

    engine.engine.tokenizer.decode = decode
    good, bad, after = _run_pair(engine, SamplingParams(max_tokens=8, ignore_eos=True),
                                 SamplingParams(max_tokens=8, ignore_eos=True), poisoned)
    _assert_isolated(engine, good, bad, after, 8)
    assert "postprocessing" in str(bad)


def test_adding_a_request_that_raises_fails_alone(tiny_dir, monkeypatch):
    """An exception other than TierguardError while a request is added (its generator, its
    detokenizer): that request gets RequestFailed instead of never an answer, and the
    engine holds nothing of it."""
    import tierguard.engine.llm_engine as llm

    real = llm.make_generator

    def make_generator(seed):
        if seed == POISON_SEED:
            raise ValueError("injected: Overflow when unpacking long long")
        return real(seed)

    monkeypatch.setattr(llm, "make_generator", make_generator)
    engine = AsyncLLMEngine(make_engine(tiny_dir))
    good, bad, after = _run_pair(engine, SamplingParams(max_tokens=8, ignore_eos=True, seed=POISON_SEED),
                                 SamplingParams(max_tokens=8, ignore_eos=True))
    _assert_isolated(engine, good, bad, after, 8)
    assert "could not add" in str(bad) and "poisoned" not in engine.engine.seqs


def test_out_of_range_sampling_is_refused_by_the_engine_itself(tiny_dir):
    """Callers other than serve's API (scripts, the demo) meet the same bounds."""
    engine = make_engine(tiny_dir)
    vocab = engine.model_config.vocab_size
    for params in (SamplingParams(seed=2**64), SamplingParams(seed=-(2**63) - 1), SamplingParams(top_k=vocab + 1),
                   SamplingParams(top_k=10**30, top_p=0.9), SamplingParams(stop=["x"] * 17),
                   SamplingParams(stop=["x" * 257]), SamplingParams(stop_token_ids=[vocab]),
                   SamplingParams(stop_token_ids=[1] * 65), SamplingParams(temperature=float("nan")),
                   SamplingParams(top_p=float("nan"))):
        with pytest.raises(TierguardError, match="out of range"):
            engine.add_request("r", [5, 6, 7], params)
    assert not engine.seqs
    engine.add_request("r", [5, 6, 7], SamplingParams(seed=2**63 - 1, top_k=vocab, stop=["x" * 256] * 16,
                                                      stop_token_ids=[vocab - 1] * 64))


def test_a_step_failure_stops_the_engine_and_answers_every_request(tiny_dir):
    """A failure no request owns (here the whole step raises): the running request and one
    still in the command queue both get EngineDeadError (started or not), failure() names
    the error, and a later request is refused at once."""
    import threading

    from tierguard.engine.api import EngineDeadError

    engine = AsyncLLMEngine(make_engine(tiny_dir))
    real_step = engine.engine.step
    entered, release = threading.Event(), threading.Event()
    state = {"steps": 0}

    def step():
        state["steps"] += 1
        if state["steps"] < 3:
            return real_step()
        entered.set()
        release.wait(60)  # hold the engine thread inside the step while a request queues up
        raise RuntimeError("injected: device lost")

    engine.engine.step = step

    async def collect(rid):
        return [o async for o in engine.generate(rid, prompt_ids(len(rid), 8),
                                                 SamplingParams(max_tokens=50, ignore_eos=True))]

    async def main():
        await engine.start()
        try:
            running = asyncio.create_task(collect("running"))
            assert await asyncio.to_thread(entered.wait, 60)
            queued = asyncio.create_task(collect("queued"))  # its "add" waits behind the step
            await asyncio.sleep(0.05)
            release.set()
            # a hang guard: both are answered as soon as the step raises
            results = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 15)
            with pytest.raises(EngineDeadError) as later:
                await anext(engine.generate("later", [5, 6, 7], SamplingParams(max_tokens=2)))
            return results, later.value
        finally:
            await engine.shutdown()

    (running, queued), later = asyncio.run(main())
    assert isinstance(running, EngineDeadError) and running.started, running
    assert isinstance(queued, EngineDeadError) and not queued.started, queued
    assert not later.started
    assert "RuntimeError: injected: device lost" in engine.failure()
