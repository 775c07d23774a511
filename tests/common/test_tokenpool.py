"""The tokenizer pool (tierguard/common/tokenpool.py): same ids off the loop, a bounded queue,
and a clean refusal (never a hang) when it is full or a worker dies."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tierguard.common.tokenpool import PoolBusy, RawTokenizer, TokenizeError, TokenizerPool


class GatedTokenizer:
    """Encodes by characters, but long texts wait until `gate` is set (to fill the queue)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 100:
            self.gate.wait(10)
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        raise ValueError("no template here")


class DyingTokenizer:
    """Kills its worker process on the magic text (an out-of-memory kill, say)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("die"):
            os._exit(1)
        return [len(text)]


@pytest.fixture(scope="module")
def tiny():
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.model.tokenizer import HFTokenizer

    return HFTokenizer(ensure_tiny_model())


def test_process_pool_gives_the_same_ids_as_the_tokenizer(tiny):
    text = "the cold contract says what goes to disk " * 40
    msgs = [{"role": "user", "content": text}]

    async def go():
        pool = TokenizerPool(tiny, workers=1)
        try:
            assert pool.stats.kind == "process"
            ids = await pool.encode(text)
            chat = await pool.encode_chat(msgs)
            short = await pool.encode("hi")
            return ids, chat, short, pool.stats
        finally:
            pool.close()

    ids, chat, short, stats = asyncio.run(go())
    assert ids == tiny.encode(text)
    assert chat == tiny.encode(tiny.apply_chat_template(msgs), add_special_tokens=False)
    assert short == tiny.encode("hi")
    assert stats.submitted == 2 and stats.inline == 1 and stats.pending == 0


def test_raw_tokenizer_json_backend_pickles_into_workers(tiny):
    async def go():
        pool = TokenizerPool(RawTokenizer(tiny.backend), workers=1)
        try:
            return await pool.encode("y" * 1000, add_special_tokens=False)
        finally:
            pool.close()

    assert asyncio.run(go()) == tiny.backend.encode("y" * 1000, add_special_tokens=False).ids


def test_a_full_queue_refuses_at_once_and_drains():
    tok = GatedTokenizer()

    async def go():
        pool = TokenizerPool(tok, workers=1, max_pending=2)
        assert pool.stats.kind == "thread"
        first = [asyncio.create_task(pool.encode("a" * 300)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(PoolBusy, match="queue is full"):
            await pool.encode("b" * 300)  # immediate, not queued behind the two
        inline = await pool.encode("short")  # short texts never wait for the pool
        tok.gate.set()
        done = await asyncio.gather(*first)
        with pytest.raises(TokenizeError, match="chat template"):
            await pool.encode_chat([{"role": "user", "content": "x" * 300}])
        pool.close()
        return inline, done, pool.stats

    inline, done, stats = asyncio.run(go())
    assert inline == [ord(c) for c in "short"] and all(len(d) == 300 for d in done)
    assert stats.rejected == 1 and stats.pending == 0


def test_a_dead_worker_is_a_busy_answer_then_a_fresh_pool():
    async def go():
        pool = TokenizerPool(DyingTokenizer(), workers=1, kind="process")
        try:
            with pytest.raises(PoolBusy, match="died"):
                await pool.encode("die" + "x" * 400)
            return await pool.encode("z" * 400)
        finally:
            pool.close()

    assert asyncio.run(go()) == [400]
