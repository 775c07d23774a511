"""A test-only engine implementing the `AsyncEngine` protocol without a model.

It exists so the HTTP layer's own logic (validation, SSE framing, abort on disconnect,
metrics plumbing) can be tested in milliseconds; end-to-end behaviour is tested
against the real engine in the other test modules. Tokens are characters (id = code
point), output is the alphabet cycling from the last prompt character, and KV blocks
are counted per live request so leaks are visible in `stats()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from tierguard.engine.api import EngineStats, RequestOutput, SamplingParams, StepStats


class CharTokenizer:
    eos_token_id: int | None = 0
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if t or not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_model_len: int = 256, delay_s: float = 0.002, block_size: int = 4) -> None:
        self.model_name = "fake"
        self.max_model_len = max_model_len
        self.tokenizer = CharTokenizer()
        self.vocab_size = CharTokenizer.vocab_size
        self.dead: str | None = None  # set by a test: the engine "stopped" with this error
        self.delay_s = delay_s
        self.block_size = block_size
        self.blocks: dict[str, int] = {}
        self.seen_params: list[SamplingParams] = []
        self.seen_classes: list[str] = []
        self._listeners: list[Callable[[StepStats], None]] = []
        self._aborted: set[str] = set()
        self._steps = 0
        self.started = False
        self.prompt_tokens = 0
        self.gen_tokens = 0

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_class: str = "interactive",
    ) -> AsyncIterator[RequestOutput]:
        self.seen_params.append(params)
        self.seen_classes.append(request_class)
        n_prompt = len(prompt_token_ids)
        self.prompt_tokens += n_prompt
        out: list[int] = []
        try:
            while True:
                if request_id in self._aborted:
                    yield RequestOutput(request_id, [], "", True, "abort", n_prompt, len(out))
                    return
                await asyncio.sleep(self.delay_s)
                tok = ord("a") + (len(out) % 26)
                out.append(tok)
                self.gen_tokens += 1
                self.blocks[request_id] = -(-(n_prompt + len(out)) // self.block_size)
                self._step(n_prompt if len(out) == 1 else 0)
                done = len(out) >= params.max_tokens
                yield RequestOutput(
                    request_id, [tok], chr(tok), done, "length" if done else None, n_prompt, len(out)
                )
                if done:
                    return
        finally:
            self.blocks.pop(request_id, None)

    def _step(self, prefill_tokens: int) -> None:
        self._steps += 1
        s = StepStats(
            self._steps,
            time.monotonic(),
            self.delay_s,
            int(prefill_tokens > 0),
            prefill_tokens,
            int(prefill_tokens == 0),
        )
        for fn in self._listeners:
            fn(s)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self.blocks.pop(request_id, None)

    def stats(self) -> EngineStats:
        used = sum(self.blocks.values())
        return EngineStats(
            num_running=len(self.blocks),
            num_waiting=0,
            kv_blocks_total=1000,
            kv_blocks_used=used,
            prefix_cache_queries=self.prompt_tokens,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.gen_tokens,
            extra={"tier.ram_blocks": 3.0},
        )

    def failure(self) -> str | None:
        return self.dead

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False
