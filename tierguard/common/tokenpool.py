"""Tokenizing off the event loop: worker processes (or threads) behind a bounded queue.

Why processes: the `tokenizers` library holds the GIL while it encodes, and a long
prompt takes a sizeable fraction of a second to encode: a thread that sleeps briefly
beside an encode in another thread sees one gap as long as the whole encode. A worker
*thread* would therefore still freeze
the event loop (health checks, every stream's next chunk) and the engine thread's
Python for that long; a worker *process* has its own GIL. Pure-Python tokenizers (tests)
run in threads: a process would only add a start-up cost.

Why bounded: every job waits in a queue of at most `max_pending` (queued + running);
one more is refused at once with `PoolBusy` (the servers answer 503 + Retry-After), so a
burst of long prompts is a clean no instead of a growing backlog. Texts of at most
`inline_bytes` are tokenized inline: a process round trip costs more than they do.

Workers start on first use; `warm()` starts them ahead (the CLI does, before it says
ready). A worker that dies (killed, out of memory) breaks the pool: the job that saw it
gets `PoolBusy`, and the next job starts a fresh pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from typing import Any

_TOKENIZER: Any = None  # the worker process's own copy


class PoolBusy(Exception):
    """The tokenizer queue is full (or its workers just died); retry shortly."""

    retry_after_s = 1


class TokenizeError(Exception):
    """The tokenizer or chat template refused this input; the message says why."""


@dataclass
class PoolStats:
    kind: str
    workers: int
    max_pending: int
    pending: int = 0  # queued + running now
    submitted: int = 0  # jobs sent to workers
    inline: int = 0  # short texts tokenized on the caller's thread
    rejected: int = 0  # refused because the queue was full or the pool broke


def _init(tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def encode_with(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_with(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Template, then encode: the ids the engine will see for this chat."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # no template, or the template rejected these messages
        raise TokenizeError(f"cannot apply the chat template: {exc}") from None
    # The template already contains BOS and friends; adding them again doubles them.
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_with(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    except Exception as exc:  # tokenizers raises plain exceptions for ids it cannot decode
        raise TokenizeError(f"cannot decode these token ids: {exc}") from None


def _decode(token_ids: list[int], skip_special_tokens: bool) -> str:  # in a worker process
    return decode_with(_TOKENIZER, token_ids, skip_special_tokens)


def _encode(text: str, add_special_tokens: bool) -> list[int]:  # in a worker process
    return encode_with(_TOKENIZER, text, add_special_tokens)


def _encode_chat(messages: list[dict], add_generation_prompt: bool) -> list[int]:  # in a worker process
    return chat_with(_TOKENIZER, messages, add_generation_prompt)


def _ready() -> bool:
    return True


class RawTokenizer:
    """A bare `tokenizers.Tokenizer` in the shape the pool calls: encode -> list of ids."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise TokenizeError("a bare tokenizer.json has no chat template")


def default_kind(tokenizer: Any) -> str:
    """Processes for a `tokenizers`-backed tokenizer (holds the GIL), threads otherwise."""
    return "process" if hasattr(tokenizer, "backend") or hasattr(tokenizer, "to_str") else "thread"


class TokenizerPool:
    def __init__(self, tokenizer: Any, *, workers: int = 2, max_pending: int = 32, inline_bytes: int = 256,
                 kind: str | None = None) -> None:
        if workers < 1 or max_pending < 1:
            raise ValueError("a tokenizer pool needs at least one worker and one queue place")
        self.tokenizer = tokenizer
        self.inline_bytes = inline_bytes
        self.stats = PoolStats(kind or default_kind(tokenizer), workers, max_pending)
        self._executor: cf.Executor | None = None

    # -- lifecycle --------------------------------------------------------------------
    def _pool(self) -> cf.Executor:
        if self._executor is None:
            if self.stats.kind == "process":
                # spawn, not fork: the server process runs an engine thread and torch.
                ctx = multiprocessing.get_context("spawn")
                self._executor = cf.ProcessPoolExecutor(self.stats.workers, mp_context=ctx, initializer=_init,
                                                        initargs=(self.tokenizer,))
            else:
                self._executor = cf.ThreadPoolExecutor(self.stats.workers, thread_name_prefix="tierguard-tok")
        return self._executor

    async def warm(self) -> None:
        """Start every worker now, so the first long prompt does not pay for it."""
        pool = self._pool()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(pool, _ready) for _ in range(self.stats.workers)))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- work -------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if _small(len(text), text.isascii(), self.inline_bytes):
            self.stats.inline += 1
            return encode_with(self.tokenizer, text, add_special_tokens)
        return await self._submit(_encode, encode_with, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        texts = [str(m.get("content") or "") for m in messages]
        if _small(sum(map(len, texts)), all(t.isascii() for t in texts), self.inline_bytes):
            self.stats.inline += 1
            return chat_with(self.tokenizer, messages, add_generation_prompt)
        return await self._submit(_encode_chat, chat_with, messages, add_generation_prompt)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids to text (vLLM's /detokenize); up to `inline_bytes / 4` ids inline, more in
        the workers: decoding holds the GIL as encoding does, for a time that grows with the text."""
        if len(token_ids) * 4 <= self.inline_bytes:
            self.stats.inline += 1
            return decode_with(self.tokenizer, token_ids, skip_special_tokens)
        return await self._submit(_decode, decode_with, list(token_ids), skip_special_tokens)

    async def _submit(self, in_process: Callable[..., Any], with_tokenizer: Callable[..., Any],
                      *args: Any) -> Any:
        s = self.stats
        if s.pending >= s.max_pending:
            s.rejected += 1
            raise PoolBusy(f"the tokenizer queue is full ({s.max_pending} requests waiting or running)")
        s.pending += 1
        s.submitted += 1
        try:
            if s.kind == "process":
                job = (in_process, *args)
            else:  # threads share this process: each job carries its pool's tokenizer
                job = (partial(with_tokenizer, self.tokenizer), *args)
            return await asyncio.get_running_loop().run_in_executor(self._pool(), *job)
        except BrokenProcessPool:
            s.rejected += 1
            self._executor = None  # the next job starts a fresh pool
            raise PoolBusy("a tokenizer worker died; retry") from None
        finally:
            s.pending -= 1


def _small(chars: int, ascii_only: bool, limit: int) -> bool:
    """At most `limit` UTF-8 bytes, decided without encoding (a character is 1 to 4 bytes)."""
    return chars <= limit if ascii_only else chars * 4 <= limit
