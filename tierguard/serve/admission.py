"""Admission in front of our own engine: the gate's controller, in process (R8).

Why the same code: `tierguard gate` guards vLLM, SGLang or llama.cpp with
`AdmissionController`; `tierguard serve` runs that very object in front of the engine,
so both say no the same way. A request is counted exactly (the engine's tokenizer),
classified (interactive / long / batch), then either admitted — holding its slot until
the response ends, stream included — rejected with 429 and Retry-After, or, for a chat
with droppable turns, downgraded: the oldest turns go (never the system prompt) until
the input fits, and the response says so in `X-Tierguard-Downgraded`.

The asynchronous path needs a job store, which lives in the gate; `serve` refuses
`--overflow async` and points at `tierguard gate` instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tierguard.gate import AdmissionController, Downgrade, HandOff, Rejected, RequestInfo, Ticket
from tierguard.gate.tokens import TokenCounter
from tierguard.gate.trim import can_trim, trim_messages
from tierguard.serve.errors import APIError

EncodeChat = Callable[[list[dict]], Awaitable[list[int]]]


class _ChatCounter(TokenCounter):
    """Counts a chat exactly as the engine will see it: template applied, then encoded.

    The ids of the last list counted are kept: `trim_messages` returns the very list it
    counted last, so the trimmed chat is not templated and encoded a second time.
    """

    source = "engine tokenizer (exact)"

    def __init__(self, encode_chat: EncodeChat) -> None:
        self._encode_chat = encode_chat
        self._last: tuple[list[dict], list[int]] | None = None

    async def count_chat(self, messages: list[dict]) -> int:
        ids = await self._encode_chat(messages)
        self._last = (messages, ids)
        return len(ids)

    async def ids(self, messages: list[dict]) -> list[int]:
        if self._last is not None and self._last[0] is messages:
            return self._last[1]
        return await self._encode_chat(messages)


@dataclass
class Admitted:
    """A request holding a slot: the token ids to run (trimmed when downgraded)."""

    ids: list[int]
    messages: list[dict] | None
    ticket: Ticket
    downgraded_from: int | None = None

    def headers(self) -> dict[str, str]:
        h = self.ticket.headers()
        if self.downgraded_from is not None:
            h["X-Tierguard-Downgraded"] = f"{self.downgraded_from}->{len(self.ids)}"
        return h


def _rejection(r: Rejected) -> APIError:
    headers = {"Retry-After": str(r.retry_after_s)} if r.retry_after_s else None
    return APIError(r.status, r.message, None, headers)


@asynccontextmanager
async def admitted(
    controller: AdmissionController,
    ids: list[int],
    priority: str,
    messages: list[dict] | None = None,
    encode_chat: EncodeChat | None = None,
) -> AsyncIterator[Admitted]:
    """Hold one admission slot for the body of the `async with`; raise APIError on a no."""
    priority = priority if priority in ("interactive", "batch") else "interactive"
    chat = messages is not None and encode_chat is not None
    info = RequestInfo(len(ids), priority, can_downgrade=chat and can_trim(messages))
    downgraded_from: int | None = None
    while True:
        try:
            ticket = await controller.acquire(info)
            break
        except Downgrade as d:
            assert messages is not None and encode_chat is not None  # can_downgrade implies chat
            counter = _ChatCounter(encode_chat)
            trimmed = await trim_messages(messages, d.max_input_tokens, counter)
            if not trimmed.fits:
                controller.record("reject", "downgrade_impossible")
                raise APIError(429, d.message + "; the turns that must stay are still too long",
                               None, {"Retry-After": "5"}) from None
            downgraded_from = downgraded_from or len(ids)
            messages = trimmed.messages
            ids = await counter.ids(messages)
            info = RequestInfo(len(ids), priority, downgraded=True)
        except Rejected as r:
            raise _rejection(r) from None
        except HandOff as h:  # unreachable when the policy was validated for serve
            raise APIError(503, f"{h.message}; asynchronous jobs are served by `tierguard gate`") from None
    try:
        yield Admitted(ids, messages, ticket, downgraded_from)
    finally:
        controller.release(ticket)
