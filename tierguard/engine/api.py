"""The contract between the engine and its front ends (HTTP server, gate, demo).

The engine computes in its own thread; front ends live in an asyncio loop. This module
holds only plain data and the protocols both sides agree on, so `tierguard/serve` can be
written and tested against it without knowing how the engine schedules work.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tierguard.common.histogram import LatencyHistogram
from tierguard.common.stats import flat

# What one request may ask of the sampler. The engine thread does this work for every
# generated token of every stream, so it is bounded where the request enters (serve's
# protocol, and `LLMEngine.validate` for every other caller); docs/hardening.md lists them.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM and torch.Generator.manual_seed
MAX_STOP_STRINGS = 16  # OpenAI allows 4; each one is searched again after every token
MAX_STOP_CHARS = 256  # per stop string; the detokenizer holds back this much text
MAX_STOP_TOKEN_IDS = 64  # each one is compared with every generated token


class RequestFailed(RuntimeError):
    """Serving one request failed inside the engine (not because of its input: that is a
    TierguardError). Only that request was aborted; the engine serves the others on."""


class EngineDeadError(RuntimeError):
    """The engine stopped after a failure it could not attribute to one request; it serves
    nothing until it is restarted. `started`: the request was already in the engine when
    it stopped (it may have caused the failure), False for one refused before it got in."""

    def __init__(self, message: str, *, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


@dataclass
class SamplingParams:
    """What to generate. `top_k=None` and `seed=None` mean "not set" (no -1 sentinels)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Prefix-cache partition (vLLM's `cache_salt`): requests share cached KV only when
    # their salts are equal (the gate sets one per tenant). None: the shared partition.
    cache_salt: str | None = None


@dataclass
class RequestOutput:
    """One increment of a request's output, as produced by one engine step.

    `new_token_ids` may hold several tokens (the engine may flush more than one per
    message); `text_delta` is their detokenized text with stop strings already cut.
    The last increment has `finished=True` and a `finish_reason` of "stop", "length" or
    "abort", or "error" with `error` set: the engine failed this request alone (a
    RequestFailed) and aborted it; front ends raise `error` instead of answering.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: Exception | None = None


@dataclass
class StepShape:
    """What a step computed, by row shape: what its cost depends on (the cost models of
    tierguard/predict are fitted on it). A row of one token is a decode (or a wave's held
    last prompt token); a chunk is a prefill piece of more tokens. Keys are the context
    positions a row attends to, summed (a chunk's tokens attend causally)."""

    token_rows: int = 0
    token_row_keys: int = 0
    chunks: int = 0
    chunk_tokens: int = 0
    chunk_keys: int = 0
    sampled: int = 0  # rows whose logits are computed (each sequence reaching its end)

    @classmethod
    def of(cls, scheduled: list) -> StepShape:
        """The shape of a schedule (tierguard.engine.sequence.ScheduledSeq items), read
        before the step moves the sequences' computed counts."""
        out = cls()
        for item in scheduled:
            start, n = item.seq.num_computed_tokens, item.num_tokens
            if n == 1:
                out.token_rows += 1
                out.token_row_keys += start + 1
            else:
                out.chunks += 1
                out.chunk_tokens += n
                out.chunk_keys += n * start + n * (n + 1) // 2
            out.sampled += bool(item.samples)
        return out


@dataclass
class StepStats:
    """What one engine step did; published to listeners after every step."""

    step: int
    started_at: float  # the engine clock's monotonic time (time.monotonic() when served)
    duration_s: float
    num_prefill_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_preempted: int = 0
    shape: StepShape = field(default_factory=StepShape)


@dataclass
class EngineStats:
    """A snapshot for /metrics and /health; cheap to take at any time."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    kv_blocks_cached: int = 0  # free blocks that still hold a prefix (evictable)
    kv_block_evictions: int = 0  # cached blocks reused for other content, total
    kv_block_size: int = 0
    extra: dict[str, float] = field(default_factory=dict)  # further gauges (KV layout, weight offload)
    # Typed tier signals (tierguard.kv.connector.TierStats) and the scheduling policy's own
    # (e.g. the naive benchmark pager's); the metrics layer exports them as `kv_*`.
    tiers: Any = None
    policy: Any = None
    # Latencies the engine measures itself, e.g. KV transfers per route ("host_to_device").
    histograms: dict[str, LatencyHistogram] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def flat(self) -> dict[str, float]:
        """Gauges and counters by metric name (without the `tierguard:engine_` prefix):
        `extra`, the pool's block counters, and the typed tier and policy stats as `kv_*`."""
        out = dict(self.extra)
        out.update(
            kv_blocks_cached=float(self.kv_blocks_cached),
            kv_block_evictions=float(self.kv_block_evictions),
            kv_block_size=float(self.kv_block_size),
        )
        out.update(flat(self.tiers, self.policy, prefix="kv_"))
        return out


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class AsyncEngine(Protocol):
    """What `tierguard serve` needs from an engine.

    Invariants: `generate` yields at least one output and exactly one with
    `finished=True`, which is the last, or raises: TierguardError for input the engine
    refuses, RequestFailed when serving this request alone failed, EngineDeadError when
    the engine stopped (then every request it had, queued or running, gets it, and so
    does every later one at once). Cancelling the consumer (e.g. the client disconnected)
    or calling `abort` frees the request's KV blocks.
    """

    model_name: str
    max_model_len: int
    vocab_size: int  # the model's (the logits' width): token ids run from 0 to vocab_size - 1
    tokenizer: Tokenizer

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_class: str = "interactive",
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def failure(self) -> str | None:
        """Why the engine stopped serving (names the error), or None while it serves."""
        ...

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
