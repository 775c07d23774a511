"""Request schemas of the OpenAI-compatible API (and vLLM's /tokenize, /detokenize).

Models are strict: a string where a number belongs is a 400, not a silent coercion,
so a client bug shows up at the edge instead of as odd sampling. Unknown fields are
ignored (clients send vendor extensions freely); fields we accept but cannot honour
are refused by `unsupported()` with a message naming the field.

Every sampling field is range-checked here, with vLLM's bounds where it has them:
floats finite, `seed` an int64, `top_k` from -1 to the vocabulary size, `stop` and
`stop_token_ids` bounded in count (and length) with ids in the vocabulary (the bounds
are in tierguard/engine/api.py and docs/hardening.md). The engine does the work a field
asks for after every generated token of a stream, so none is left unbounded; the
vocabulary-dependent checks are `out_of_range(vocab_size)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tierguard.engine.api import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from tierguard.kv.contract import CLASS_HEADER, CLASS_HEADER_ALIAS, classify_request
from tierguard.serve.errors import APIError, bad_request

MAX_CACHE_SALT = 1024  # characters of `cache_salt` (hashed once per request)


class _Strict(BaseModel):
    # JSON's NaN / Infinity extensions (which Python and pydantic read) are refused.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extension: usage on every chunk, not only a final usage-only chunk.
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    # Finite; 0 is greedy, and a positive value below 0.01 samples as 0.01 (as in vLLM).
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM accepts 0 or -1 for "disabled"; we map both to None (no sentinel inside). At most
    # the vocabulary size (`out_of_range`).
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)  # int64, as vLLM
    # At most MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS characters (`out_of_range`).
    stop: str | list[str] | None = None
    # At most MAX_STOP_TOKEN_IDS ids, each in the vocabulary (`out_of_range`).
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # tierguard extension: the engine's admission/tier policy class of this request
    # (e.g. "interactive" or "batch"); `tierguard gate` sets it.
    request_class: str = Field(default="interactive", pattern=r"^[a-z][a-z0-9_]{0,31}$")
    # OpenAI / vLLM ways of saying the same: a positive priority or a flex/batch tier is batch.
    priority: int | str | None = None
    service_tier: str | None = None
    # vLLM's prefix-cache partition: requests share cached KV (every tier) only when their
    # salts are equal. `tierguard gate --cache-isolation per-key` sets one per API key.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)

    def resolve_class(self, headers: Mapping[str, str]) -> str:
        """The class header wins (`X-Tierguard-Priority`, or the older `X-Tierguard-Class`):
        `tierguard gate` sends the class it admitted the request as, and a body must not
        override that. Without one (a direct client), the body's `request_class`, then its
        `priority` / `service_tier`."""
        if any(headers.get(name) for name in (CLASS_HEADER, CLASS_HEADER_ALIAS)):
            return classify_request(None, headers)
        if "request_class" in self.model_fields_set:
            return self.request_class
        return classify_request({"priority": self.priority, "service_tier": self.service_tier}, headers)

    def out_of_range(self, vocab_size: int | None) -> APIError | None:
        """The bounds that need the model's vocabulary size (None: the engine gave none),
        and the stop bounds; a 400 naming the field."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            return bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            return bad_request(
                f"each stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}", "stop"
            )
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            return bad_request(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", "stop_token_ids"
            )
        if vocab_size is None:
            return None
        if self.top_k is not None and self.top_k > vocab_size:
            return bad_request(
                f"top_k must be -1 or 0 (disabled) or at most the vocabulary size {vocab_size}, got {_num(self.top_k)}",
                "top_k",
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return bad_request(
                f"stop_token_ids {bad[:3]} are outside the vocabulary [0, {vocab_size})", "stop_token_ids"
            )
        return None

    def _common_unsupported(self) -> APIError | None:
        if self.n != 1:
            return bad_request(
                f"n={self.n} is not supported: this server returns exactly one choice (n=1)", "n"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return bad_request(f"{name} is not supported by this engine; omit it or send 0", name)
        if self.logit_bias:
            return bad_request("logit_bias is not supported by this engine", "logit_bias")
        if self.stream_options is not None and not self.stream:
            return bad_request("stream_options is only allowed when stream=true", "stream_options")
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else None,
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _num(n: int) -> str:
    """An integer for a message: in full unless it is absurdly long."""
    return str(n) if abs(n) < 10**20 else f"a number of {n.bit_length()} bits"


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy default; chat defaults to "the rest of the context" instead.
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def unsupported(self) -> APIError | None:
        if self.logprobs is not None:
            return bad_request("logprobs is not supported by this engine; omit it", "logprobs")
        if self.echo:
            return bad_request("echo is not supported; omit it or send false", "echo")
        if self.best_of not in (None, 1):
            return bad_request(f"best_of={self.best_of} is not supported (only 1)", "best_of")
        if self.suffix:
            return bad_request("suffix is not supported", "suffix")
        return self._common_unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of several prompts is refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return p  # type: ignore[return-value]
        if len(p) != 1:
            raise bad_request(
                f"a batch of {len(p)} prompts is not supported; send one prompt per request", "prompt"
            )
        return p[0]  # type: ignore[return-value]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"message content part of type {part.type!r} is not supported (text only)", "messages"
                )
            pieces.append(part.text)
        return "".join(pieces)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> APIError | None:
        if self.logprobs or self.top_logprobs:
            return bad_request("logprobs is not supported by this engine; omit it", "logprobs")
        if self.tools:
            return bad_request("tools are not supported by this server", "tools")
        return self._common_unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def plain_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: either `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
