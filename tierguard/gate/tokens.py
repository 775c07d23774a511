"""Counting input tokens before admission.

Why count at all: classes (short/long) and the input cap are in tokens, and the gate
must decide before the upstream spends a prefill. Three sources, chosen once at start
and named in the log:

- a local tokenizer directory (`tokenizer.json`, loaded with the `tokenizers` library).
  Chat is counted as the sum of its message texts plus a small per-message overhead;
  that approximates the chat template without needing one;
- the upstream's `/tokenize` endpoint (vLLM, SGLang and our schedule server have it),
  one extra loopback round trip per request, exact for the upstream's own template;
- a last-resort estimate of one token per 4 characters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

PER_MESSAGE_OVERHEAD = 4  # role markers and separators a chat template adds per message
CHARS_PER_TOKEN = 4


def message_text(message: dict) -> str:
    """The text of one chat message; multi-part content keeps only its text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class TokenCounter:
    """Base: the estimate. Subclasses replace `count_text` and may replace `count_chat`."""

    source = "approximate (1 token per 4 characters)"

    async def count_text(self, text: str) -> int:
        return max(1, len(text) // CHARS_PER_TOKEN) if text else 0

    async def count_chat(self, messages: list[dict]) -> int:
        total = 2
        for m in messages:
            total += PER_MESSAGE_OVERHEAD + await self.count_text(message_text(m))
        return total

    async def count_body(self, body: dict, chat: bool) -> int:
        if chat:
            messages = body.get("messages")
            return await self.count_chat(messages if isinstance(messages, list) else [])
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):  # a batch of prompts, or a list of token ids
            if prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            return sum([await self.count_text(str(p)) for p in prompt])
        return await self.count_text(str(prompt))


class LocalTokenizer(TokenCounter):
    """A `tokenizer.json` from a local directory; never downloads anything."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        self.source = f"local tokenizer {directory}"

    async def count_text(self, text: str) -> int:
        if not text:
            return 0
        if len(text) > 20_000:  # a long prompt would stall the event loop for milliseconds
            enc = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
        else:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
        return len(enc.ids)


class UpstreamTokenizer(TokenCounter):
    """The upstream's `/tokenize`; falls back to the estimate when a call fails."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> None:
        self.session = session
        self.url = base_url + "/tokenize"
        self.headers = headers
        self.source = f"upstream {self.url}"
        self.failures = 0

    async def _call(self, payload: dict) -> int | None:
        try:
            async with self.session.post(self.url, json=payload, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    self.failures += 1
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.failures += 1
            return None
        if isinstance(data.get("count"), int):
            return data["count"]
        tokens = data.get("tokens")
        return len(tokens) if isinstance(tokens, list) else None

    async def count_text(self, text: str) -> int:
        n = await self._call({"prompt": text})
        return n if n is not None else await super().count_text(text)

    async def count_chat(self, messages: list[dict]) -> int:
        n = await self._call({"messages": messages})
        return n if n is not None else await super().count_chat(messages)

    async def probe(self) -> bool:
        """True when the upstream answers /tokenize; decides the source at start."""
        return await self._call({"prompt": "probe"}) is not None
