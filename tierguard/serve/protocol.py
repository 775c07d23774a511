"""Request schemas of the OpenAI-compatible API (and vLLM's /tokenize, /detokenize).

Models are strict: a string where a number belongs is a 400, not a silent coercion,
so a client bug shows up at the edge instead of as odd sampling. Unknown fields are
ignored (clients send vendor extensions freely); fields we accept but cannot honour
are refused by `unsupported()` with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tierguard.engine.api import SamplingParams
from tierguard.kv.contract import classify_request
from tierguard.serve.errors import APIError, bad_request

MAX_CACHE_SALT = 1024  # characters of `cache_salt` (hashed once per request)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extension: usage on every chunk, not only a final usage-only chunk.
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM accepts 0 or -1 for "disabled"; we map both to None (no sentinel inside).
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
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
        """tierguard's own `request_class` wins (the gate sets it); otherwise the
        `x-tierguard-class` header, then `priority` / `service_tier`."""
        if "request_class" in self.model_fields_set:
            return self.request_class
        return classify_request({"priority": self.priority, "service_tier": self.service_tier}, headers)

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
