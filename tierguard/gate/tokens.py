"""Counting input tokens before admission.

Why count at all: classes (short/long) and the input cap are in tokens, and the gate
must decide before the upstream spends a prefill. Three sources, chosen once at start
and named in the log:

- a local tokenizer directory (`tokenizer.json`, loaded with the `tokenizers` library).
  Chat is counted as the sum of its message texts plus a small per-message overhead;
  that approximates the chat template without needing one;
- the upstream's `/tokenize` endpoint (vLLM, SGLang and our schedule server have it),
  exact for the upstream's own template but one extra loopback round trip;
- a last-resort estimate of one token per 4 characters.

Why most requests are not counted exactly (the byte bound, `tokens_bound.py`): an
exact count only matters when it could change the decision. When a cheap upper bound
from UTF-8 byte counts is already below the long threshold and the input cap, the
request is surely short and within the cap, so the round trip to `/tokenize` (tens of
milliseconds of TTFT under load) is skipped. Only requests near a limit are counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tierguard.common.redact import redact_url
from tierguard.common.tokenpool import RawTokenizer, TokenizerPool
from tierguard.gate.tokens_bound import PROBE_TEXT, TEXT_SLACK_TOKENS, byte_bound, is_byte_level, utf8_len
from tierguard.gate.tokens_fit import token_bytes_from_json

PER_MESSAGE_OVERHEAD = 4  # role markers and separators a chat template adds per message
CHARS_PER_TOKEN = 4


def message_text(message: object) -> str:
    """The text of one chat message; multi-part content keeps only its text parts."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


@dataclass
class TokenCount:
    """Input tokens for admission. `method` says how far to trust `tokens`:
    "exact" (the tokenizer counted), "estimate" (1 token per 4 characters, no tokenizer),
    or "byte_bound" (not counted: the byte bound proved the request short and within
    the cap; `tokens` is then the 4-characters estimate, which is below that bound)."""

    tokens: int
    method: str


class TokenCounter:
    """Base: the estimate. Subclasses replace `count_text` and may replace `count_chat`.

    `byte_bound_ok` says whether the byte bound is a valid upper bound for this
    counter's exact counts; `exact_counts`/`bound_skips` count requests by path.
    """

    source = "approximate (1 token per 4 characters)"
    method = "estimate"
    byte_bound_ok = False
    # class-level zeros (subclasses need no __init__ chain); incremented per instance
    exact_counts = 0  # admission counts that ran the tokenizer
    bound_skips = 0  # admission counts the byte bound made unnecessary

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

    async def count_for_admission(self, body: dict, chat: bool, limit: int) -> TokenCount:
        """Tokens for the admission decision. `limit` is the smallest count that would change
        it (the long threshold, or the input cap + 1 when lower): below it every count
        leads to the same decision, so a bound below it is as good as an exact count."""
        if self.byte_bound_ok:
            bound = byte_bound(body, chat)
            if bound is not None and bound < limit:
                self.bound_skips += 1
                return TokenCount(await TokenCounter.count_body(_ESTIMATE, body, chat), "byte_bound")
        n = await self.count_body(body, chat)
        if self.method == "exact":
            self.exact_counts += 1
        return TokenCount(n, self.method)


_ESTIMATE = TokenCounter()  # the estimate, used for the logged figure of uncounted requests


class LocalTokenizer(TokenCounter):
    """A `tokenizer.json` from a local directory; never downloads anything.

    Long texts are counted by worker processes (`common/tokenpool.py`): `tokenizers`
    holds the GIL while it encodes, so a thread would still stall the event loop. A full
    queue raises `PoolBusy` (the gate answers 503)."""

    method = "exact"

    def __init__(self, directory: str, use_byte_bound: bool = True, workers: int = 2, max_pending: int = 32) -> None:
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        tok_json = json.loads(path.read_text(encoding="utf-8"))
        # Only a byte-level BPE guarantees at least one byte per token; anything else
        # (WordPiece, Unigram without byte fallback, ...) is always counted exactly.
        self.byte_level = is_byte_level(tok_json)
        self.byte_bound_ok = use_byte_bound and self.byte_level
        self.token_bytes = token_bytes_from_json(tok_json, self.tokenizer.get_vocab(with_added_tokens=True))
        self.pool = TokenizerPool(RawTokenizer(self.tokenizer), workers=workers, max_pending=max_pending)
        self.source = f"local tokenizer {directory}" + (" (byte-level: byte bound on)" if self.byte_bound_ok
                                                        else " (exact count for every request)")

    async def count_text(self, text: str) -> int:
        if not text:
            return 0
        return len(await self.pool.encode(text, add_special_tokens=False))


class UpstreamTokenizer(TokenCounter):
    """The upstream's `/tokenize`; falls back to the estimate when a call fails."""

    method = "exact"

    def __init__(self, session: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                 use_byte_bound: bool = True, pick: Callable[[], str] | None = None) -> None:
        self.session = session
        self.url = base_url + "/tokenize"
        self.pick = pick  # several upstreams: the base URL of a healthy one, per call
        self.headers = headers
        self.source = f"upstream {redact_url(self.url)}"
        self.failures = 0
        self.use_byte_bound = use_byte_bound

    async def _call(self, payload: dict) -> int | None:
        try:
            url = self.pick() + "/tokenize" if self.pick is not None else self.url
            async with self.session.post(url, json=payload, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    self.failures += 1
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.failures += 1
            return None
        if not isinstance(data, dict):  # not the answer /tokenize gives: count another way
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
        """True when the upstream answers /tokenize; decides the source at start.

        The probe text mixes ASCII, accents, CJK and an emoji: the byte bound stays on
        only if the upstream's count for it respects one token per byte (plus slack),
        so a tokenizer that breaks the assumption is counted exactly instead.
        """
        n = await self._call({"prompt": PROBE_TEXT})
        if n is None:
            return False
        self.byte_bound_ok = self.use_byte_bound and n <= utf8_len(PROBE_TEXT) + TEXT_SLACK_TOKENS
        self.source += " (byte bound on)" if self.byte_bound_ok else " (exact count for every request)"
        return True
