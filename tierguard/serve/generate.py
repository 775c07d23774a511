"""The two generating endpoints: /v1/completions and /v1/chat/completions.

Both share one path: read the body (size limit, deadline) → validate → refuse what
cannot fit by the byte rule → tokenize (off the loop, bounded queue) → check the
context budget → run the engine request → stream chunks or gather one body. The invariant that matters for memory:
every engine request either finishes or is aborted here (`finally`), whether the
client read to the end, disconnected mid-stream, or the handler was cancelled, so
its KV blocks always return to the pool. Every request gets an answer: what the engine
raises (refused input, a failure of this request alone, a stopped engine) becomes an
error status before the first byte and an error event after it (`errors.engine_error`),
and once the engine has stopped, new requests get 503 before any work is done for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from tierguard.common.peers import Backlog, BodyError, PeerGuard, SlowReader
from tierguard.common.tokenpool import PoolBusy, TokenizeError, TokenizerPool
from tierguard.engine.api import AsyncEngine, RequestOutput
from tierguard.gate import AdmissionController
from tierguard.gate.tokens_fit import TokenBytes, chat_bytes, text_bytes
from tierguard.serve.admission import admitted
from tierguard.serve.errors import APIError, bad_request, dead_header, engine_error
from tierguard.serve.metrics import ServeMetrics
from tierguard.serve.protocol import ChatCompletionRequest, CompletionRequest
from tierguard.serve.responses import Shape, usage
from tierguard.serve.sse import ClientGone, SSEWriter

log = logging.getLogger("tierguard.serve")
T = TypeVar("T")

@dataclass
class ServeState:
    """What every handler needs; stored on the app under `STATE_KEY`."""

    engine: AsyncEngine
    served_model_names: list[str]
    api_key: str | None
    metrics: ServeMetrics
    admission: AdmissionController | None = None  # None: every request goes straight to the engine
    started_at: float = field(default_factory=time.time)
    guard: PeerGuard = field(default_factory=PeerGuard)  # slow peers, body limits, edge counters
    pool: TokenizerPool | None = None  # tokenizing off the event loop; None: built from the engine
    token_bytes: TokenBytes | None = None  # the byte rule; None: this tokenizer has none
    max_body_bytes: int = 64 * 1024**2
    # `--enable-prompt-tokens-details`: report usage.prompt_tokens_details.cached_tokens.
    # Off by default: it reveals whether another client sent the same prefix.
    prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if self.pool is None:
            self.pool = TokenizerPool(self.engine.tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.served_model_names)}.",
                "model",
            )

    async def read_body(self, request: web.Request) -> bytes:
        """The body within the size limit and the body timeout (413 / 408 otherwise)."""
        try:
            return await self.guard.read_body(request, self.max_body_bytes)
        except BodyError as exc:
            raise APIError(exc.status, exc.message) from None

    def check_engine(self) -> None:
        """503 at once when the engine has stopped: nothing can be generated any more."""
        why = self.engine.failure()
        if why is not None:
            raise APIError(503, f"this server cannot generate: {why}; it must be restarted", None, dead_header())

    def check_request(self, req: CompletionRequest | ChatCompletionRequest, headers) -> None:
        """Class, then everything refused before any work: unsupported or out-of-range
        fields, the model name, a stopped engine."""
        req.request_class = req.resolve_class(headers)
        _refuse(req.unsupported())
        _refuse(req.out_of_range(self.engine.vocab_size))
        self.check_model(req.model)
        self.check_engine()

    def refuse_unfit(self, nbytes: int | None) -> None:
        """The byte rule: refuse a text that cannot fit before any tokenizer runs on it."""
        limit = self.engine.max_model_len
        if nbytes is not None and self.token_bytes is not None and self.token_bytes.cannot_fit(nbytes, limit):
            self.guard.counters.byte_rule_refusals += 1
            raise bad_request(self.token_bytes.refusal(nbytes, limit), "prompt")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.refuse_unfit(text_bytes(text))
        return await self._pooled(self.pool.encode(text, add_special_tokens))

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        self.refuse_unfit(chat_bytes(messages))
        return await self._pooled(self.pool.encode_chat(messages, add_generation_prompt))

    async def decode(self, token_ids: list[int]) -> str:
        """/detokenize: the text of these ids (special tokens kept), decoded in the pool."""
        return await self._pooled(self.pool.decode(token_ids, skip_special_tokens=False), "tokens")

    async def _pooled(self, job: Awaitable[T], param: str = "messages") -> T:
        try:
            return await job
        except PoolBusy as exc:
            raise APIError(503, f"{exc}; retry shortly", None, {"Retry-After": str(exc.retry_after_s)}) from None
        except TokenizeError as exc:
            raise bad_request(str(exc), param) from None

    def budget(self, num_prompt: int, requested: int | None) -> int:
        """max_tokens to run with; refuses requests that cannot fit the context."""
        limit = self.engine.max_model_len
        if num_prompt == 0:
            raise bad_request("the prompt is empty (0 tokens)", "prompt")
        if num_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt} tokens, leaving no room for output.",
                "prompt",
            )
        max_tokens = limit - num_prompt if requested is None else requested
        if num_prompt + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                f"completion). Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return max_tokens


class _Timer:
    """Per-request latencies as the server sees them (arrival → each output message)."""

    def __init__(self, metrics: ServeMetrics, arrival: float) -> None:
        self._m = metrics
        self.arrival = arrival
        self._last: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self.arrival)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now

    def on_finished(self, out: RequestOutput) -> None:
        self._m.on_finished(
            out.finish_reason, out.num_prompt_tokens, out.num_output_tokens, time.monotonic() - self.arrival
        )


async def completions(request: web.Request, state: ServeState) -> web.StreamResponse:
    arrival = time.monotonic()
    req = CompletionRequest.model_validate_json(await state.read_body(request))
    state.check_request(req, request.headers)
    prompt = req.single_prompt()
    ids = list(prompt) if isinstance(prompt, list) else await state.encode(prompt, add_special_tokens=True)
    max_tokens = state.budget(len(ids), req.max_tokens)  # refuse what can never fit before it takes a slot
    if state.admission is None:
        return await _run(request, state, req, ids, max_tokens, arrival, chat=False)
    async with admitted(state.admission, ids, req.request_class) as slot:
        return await _run(request, state, req, slot.ids, max_tokens, arrival, chat=False, headers=slot.headers())


async def chat_completions(request: web.Request, state: ServeState) -> web.StreamResponse:
    arrival = time.monotonic()
    req = ChatCompletionRequest.model_validate_json(await state.read_body(request))
    state.check_request(req, request.headers)
    messages = req.plain_messages()
    ids = await state.encode_chat(messages, req.add_generation_prompt)
    if state.admission is None:
        return await _run(
            request, state, req, ids, state.budget(len(ids), req.requested_max_tokens()), arrival, chat=True
        )

    async def encode(msgs: list[dict]) -> list[int]:
        return await state.encode_chat(msgs, req.add_generation_prompt)

    async with admitted(state.admission, ids, req.request_class, messages, encode) as slot:
        max_tokens = state.budget(len(slot.ids), req.requested_max_tokens())
        return await _run(request, state, req, slot.ids, max_tokens, arrival, chat=True, headers=slot.headers())


def _refuse(err: APIError | None) -> None:
    if err is not None:
        raise err


def _raise_engine_error(exc: Exception) -> None:
    """Raise the API's answer to what the engine raised, or `exc` itself if it has none."""
    err = engine_error(exc)
    if err is None:
        raise exc
    raise err from exc


@dataclass
class _Progress:
    """Whether the engine already finished the request (then no abort is needed)."""

    finished: bool = False


async def _run(
    request: web.Request,
    state: ServeState,
    req: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    max_tokens: int,
    arrival: float,
    *,
    chat: bool,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    shape = Shape(chat=chat, model=req.model or state.served_model_names[0])
    timer = _Timer(state.metrics, arrival)
    progress = _Progress()
    gen = state.engine.generate(shape.id, ids, req.sampling_params(max_tokens), req.request_class)
    try:
        # The first output is awaited before any header goes out, so a request the
        # engine refuses still gets a proper HTTP status instead of a 200 stream.
        try:
            first = await anext(gen)
        except StopAsyncIteration:
            raise APIError(500, "the engine produced no output for this request") from None
        except Exception as exc:
            _raise_engine_error(exc)
        outputs = _chain(first, gen, progress)
        if req.stream:
            return await _stream(
                request, req, shape, timer, outputs, headers, state.guard.backlog(request), state.prompt_tokens_details
            )
        pieces: list[str] = []
        last = first
        try:
            async for out in outputs:
                timer.on_output(out)
                pieces.append(out.text_delta)
                last = out
        except Exception as exc:
            _raise_engine_error(exc)
        timer.on_finished(last)
        return web.json_response(
            shape.whole(
                "".join(pieces),
                last.finish_reason,
                _usage_of(last, state.prompt_tokens_details),
            ),
            headers=headers,
        )
    finally:
        await _close(gen)
        if not progress.finished:
            state.metrics.on_aborted()
            # Shielded: when the handler itself is being cancelled (client gone), the
            # abort must still reach the engine or the request's blocks stay allocated.
            await asyncio.shield(_abort(state.engine, shape.id))


async def _chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput], progress: _Progress
) -> AsyncIterator[RequestOutput]:
    progress.finished = first.finished
    yield first
    if first.finished:
        return
    async for out in rest:
        progress.finished = out.finished
        yield out


async def _stream(
    request: web.Request,
    req: CompletionRequest | ChatCompletionRequest,
    shape: Shape,
    timer: _Timer,
    outputs: AsyncIterator[RequestOutput],
    headers: dict[str, str] | None = None,
    backlog: Backlog | None = None,
    details: bool = False,
) -> web.StreamResponse:
    sse = SSEWriter(request, backlog)
    sse.response.headers.update(headers or {})
    await sse.open()
    try:
        async for out in outputs:
            timer.on_output(out)
            if out.text_delta or out.finished:
                cont = _usage_of(out, details) if req.continuous_usage else None
                await sse.send(shape.chunk(out.text_delta, out.finish_reason if out.finished else None, cont))
            if out.finished:
                timer.on_finished(out)
                if req.include_usage:
                    await sse.send(shape.usage_chunk(_usage_of(out, details)))
        await sse.done()
    except ClientGone as exc:
        why = "stopped reading (slow reader)" if isinstance(exc.__cause__, SlowReader) else "went away"
        log.info("client %s during %s; aborting it", why, shape.id)
    except Exception as exc:  # headers are out: the failure can only travel as an event
        err = engine_error(exc)
        if err is None:  # not an engine failure (logged there): a bug here
            log.exception("request %s failed mid-stream", shape.id)
            err = APIError(500, f"generation failed: {exc}")
        else:
            log.warning("request %s failed mid-stream: %s", shape.id, err.message)
        try:
            await sse.send(err.body())
            await sse.done()
        except ClientGone:
            pass
    return sse.response


def _usage_of(out: RequestOutput, details: bool) -> dict:
    return usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens if details else 0)


async def _close(gen: object) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # a broken generator must not hide the abort that follows
            log.exception("closing the engine stream failed")


async def _abort(engine: AsyncEngine, request_id: str) -> None:
    try:
        await engine.abort(request_id)
    except Exception:
        log.exception("aborting %s failed", request_id)
