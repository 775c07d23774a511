"""Response bodies for completions and chat completions, streamed or whole.

Plain dicts rather than pydantic models: a stream sends one body per token, and
building a dict is several times cheaper than validating a model we wrote ourselves.
The two endpoints differ only in object names and in where the text goes, so one
`Shape` per request hides that difference from the handler.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The usage object; `prompt_tokens_details.cached_tokens` when some prompt tokens
    came from the prefix cache. The server passes them only with
    `--enable-prompt-tokens-details` (vLLM's flag, and vLLM's shape): the count tells a
    client whether someone else sent the same opening text, so it stays off unless every
    client may know that (generate.py)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


@dataclass
class Shape:
    """Builds the bodies of one request; `chat` selects chat.completion objects."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _sent_role: bool = False

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, text: str, finish_reason: str | None, usage_body: dict | None = None) -> dict:
        """One SSE chunk; the first chat chunk also carries the assistant role."""
        if self.chat:
            delta: dict = {"content": text}
            if not self._sent_role:
                delta = {"role": "assistant", "content": text}
                self._sent_role = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if usage_body is not None:
            body["usage"] = usage_body
        return body

    def usage_chunk(self, usage_body: dict) -> dict:
        """The final chunk of `stream_options.include_usage`: no choices, only usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage_body
        return body

    def whole(self, text: str, finish_reason: str | None, usage_body: dict) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_body
        return body
