"""Forwarding one admitted request to the upstream, streaming chunks through untouched.

Why no SSE parsing: every parse on the hot path adds latency to every chunk of every
stream. Whatever the upstream has sent is written to the client at once (one read, one
write per wake-up); the gate only counts `data:` events (one substring count) and reads
`usage` with a regex when a chunk carries it. The closing `data: [DONE]` event carries
no token, so it leaves together with the end of the response (one socket write, not
two). Timing: TTFT is arrival at the gate to the first chunk written; ITL is the gap
between chunks written. Connections to the upstream are pooled (keep-alive) and both
sides run with TCP_NODELAY (aiohttp sets it on every connection).

Failures map to clear statuses before any byte is sent: upstream unreachable -> 502,
no first byte within the timeout -> 504. After the stream started, a failure ends the
stream with one SSE error event (the status line is already gone).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tierguard.common.peers import PeerGuard, SlowReader
from tierguard.common.redact import redact_url

# Set by `tierguard serve` on answers of an engine that stopped after an error: the gate
# ejects the replica at once (a plain 503 means busy and is only tried elsewhere).
ENGINE_STATE_HEADER = "X-Tierguard-Engine-State"

_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_USAGE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_DONE = b"data: [DONE]\n\n"


class UpstreamError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


@dataclass
class ForwardResult:
    status: int
    output_tokens: int | None = None
    prompt_tokens: int | None = None  # from the upstream's usage, when it sent one
    first_chunk_at: float | None = None  # time.monotonic() of the first byte sent to the client
    ended_at: float = 0.0
    client_left: bool = False
    slow_reader: bool = False  # the client left too much output unread; its stream was ended
    response: web.StreamResponse | None = None


@dataclass
class Upstream:
    session: aiohttp.ClientSession
    base_url: str
    headers: dict[str, str]
    first_byte_timeout_s: float

    async def post(self, path: str, payload: bytes, extra_headers: dict[str, str] | None = None,
                   ) -> aiohttp.ClientResponse:
        """Send the request and wait for the response headers; raise UpstreamError on failure."""
        headers = {**self.headers, **extra_headers} if extra_headers else self.headers
        try:
            async with asyncio.timeout(self.first_byte_timeout_s):
                return await self.session.post(self.base_url + path, data=payload, headers=headers)
        except TimeoutError:
            raise UpstreamError(504, "timeout", f"upstream sent no response within {self.first_byte_timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(502, "unreachable", f"upstream {redact_url(self.base_url)} is unreachable: "
                                                     f"{exc.strerror or exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(502, "error", f"upstream request failed: {type(exc).__name__}") from None

    async def post_json(self, path: str, body: dict, extra_headers: dict[str, str] | None = None,
                        ) -> tuple[int, dict]:
        """A whole non-streaming exchange (async jobs). An answer marked `ENGINE_STATE_HEADER:
        dead` raises UpstreamError of kind "engine_dead": the replica cannot serve anyone."""
        resp = await self.post(path, json.dumps(body).encode(), extra_headers)
        if resp.headers.get(ENGINE_STATE_HEADER) == "dead":
            resp.release()
            raise UpstreamError(resp.status, "engine_dead", f"upstream {redact_url(self.base_url)}: its engine stopped")
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(502, "error", f"upstream response cut off: {type(exc).__name__}") from None
        finally:
            resp.release()
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"error": {"message": raw[:500].decode(errors="replace")}}
        return resp.status, data if isinstance(data, dict) else {"data": data}


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, extra_headers: dict[str, str],
                first_byte_timeout_s: float, on_chunk_gap=None, guard: PeerGuard | None = None,
                on_first=None) -> ForwardResult:
    """Copy the upstream response to the client; returns what the gate observed.

    `on_chunk_gap(seconds)` is called for every inter-chunk gap (ITL histogram);
    `on_first(monotonic time)` when a stream's first chunk arrived (not for a whole body). With a
    `guard`, a client that leaves more than its slow-reader mark unread has its stream
    ended (`SlowReader`): the upstream request is closed and the slot freed.
    """
    result = ForwardResult(status=upstream.status)
    ctype = upstream.headers.get("Content-Type", "application/json")
    try:
        if upstream.status != 200 or "text/event-stream" not in ctype:
            raw = await upstream.read()
            result.first_chunk_at = time.monotonic()
            result.output_tokens, result.prompt_tokens = _usage(raw)
            resp = web.Response(body=raw, status=upstream.status, headers={"Content-Type": ctype, **extra_headers})
            result.response = resp
            result.ended_at = time.monotonic()
            return result
        resp = web.StreamResponse(status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache",
                                                       **extra_headers})
        result.response = resp
        content = upstream.content
        async with asyncio.timeout(first_byte_timeout_s):
            first = await content.readany()
        if on_first is not None and first:
            on_first(time.monotonic())
        await resp.prepare(request)  # headers leave with the first chunk
        backlog = guard.backlog(request) if guard is not None else None
        # The hot loop: per chunk one read of everything the upstream has sent, one write,
        # one clock read, one substring count; usage is parsed only in chunks that carry it.
        events, usage = 0, None
        readany, monotonic = content.readany, time.monotonic
        write = resp.write if backlog is None else _checked(resp.write, backlog.check)
        chunk, last, tail = first, 0.0, b""
        if chunk:
            await write(chunk)
            last = result.first_chunk_at = monotonic()
        while chunk:
            events += chunk.count(b"data:")
            if b'"usage"' in chunk:
                usage = _take_usage(result, chunk, usage)
            chunk = await readany()
            if not chunk:
                break
            if chunk.endswith(_DONE):
                # The stream's closing event carries no token: it leaves together with the
                # end of the response (one write instead of two). Anything an upstream sends
                # after [DONE] is kept and goes out with it.
                tail = chunk
                while more := await readany():
                    tail += more
                events += tail.count(b"data:")
                if b'"usage"' in tail:
                    usage = _take_usage(result, tail, usage)
                break
            await write(chunk)
            now = monotonic()
            if on_chunk_gap is not None:
                on_chunk_gap(now - last)
            last = now
        if events:
            # without usage, count content events: one per chunk minus [DONE]
            result.output_tokens = usage if usage is not None else max(0, events - 1)
        await resp.write_eof(tail)
    except TimeoutError:
        result.status = 504
        await _end_stream(result, "upstream stopped sending (timeout)")
    except ConnectionResetError as exc:  # aiohttp's write to a gone client raises a subclass of it
        result.client_left = True
        result.slow_reader = isinstance(exc, SlowReader)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        result.status = 502
        await _end_stream(result, f"upstream stream broke: {type(exc).__name__}")
    finally:
        if result.client_left or not upstream.content.is_eof():
            upstream.close()  # cancelled or cut off: drop the connection so the engine stops generating
        else:
            upstream.release()
        result.ended_at = time.monotonic()
    return result


def _checked(write, check):
    """`write`, after the slow-reader check (which raises SlowReader, a ConnectionResetError)."""

    async def checked_write(data: bytes) -> None:
        check()
        await write(data)

    return checked_write


def _usage(raw: bytes) -> tuple[int | None, int | None]:
    """(completion_tokens, prompt_tokens) from a body or chunk that carries usage."""
    out, prompt = _USAGE.search(raw), _PROMPT_USAGE.search(raw)
    return (int(out.group(1)) if out else None), (int(prompt.group(1)) if prompt else None)


def _take_usage(result: ForwardResult, raw: bytes, usage: int | None) -> int | None:
    """Note prompt_tokens on `result`; return completion_tokens, or `usage` when absent."""
    found, prompt = _usage(raw)
    if prompt is not None:
        result.prompt_tokens = prompt
    return found if found is not None else usage


async def _end_stream(result: ForwardResult, message: str) -> None:
    """After headers went out the status cannot change: send one SSE error event."""
    resp = result.response
    if resp is None or not resp.prepared:
        raise UpstreamError(result.status, "timeout" if result.status == 504 else "error", message)
    body = {"error": {"message": message, "type": "upstream_error", "code": result.status}}
    try:
        await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionError):
        result.client_left = True
