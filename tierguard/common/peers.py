"""Slow peers, for both servers: header and body deadlines, and a slow-reader policy.

What aiohttp offers and what it lacks (3.9–3.14): `client_max_size` bounds a body's
size, and `keepalive_timeout` closes idle kept-alive connections. It has no deadline
for a request's headers, none for its body, and a response writer waits in `drain()`
for as long as the peer does not read. A few hundred sockets that trickle their headers
(slowloris), a body sent one byte a second, or a client that stops reading a stream
each hold a socket, and the last also a slot and its KV, for as long as they like.
So, with one counter each in /metrics:

- header timeout: a thin protocol wrapper (`peer_conn.py`) arms a timer when a connection opens, and
  again at the first byte of a later request; the middleware cancels it when the
  request's headers are complete (that is when aiohttp calls a handler). When it fires,
  the peer gets a JSON 408 and the connection is closed.
- body timeout: `read_body` reads within a deadline (and a size limit) -> 408 (413).
- slow reader: before each write of a stream, `Backlog.check()` adds the bytes still
  queued for the peer in the process (transport buffer) and in the kernel (SIOCOUTQ,
  Linux); above the high-water mark the connection is aborted and `SlowReader` (a
  ConnectionResetError, which both servers already treat as "client gone") is raised,
  so the usual path frees the admission slot and aborts the engine request (its KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import sys
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from tierguard.common.errors import TierguardError


class WatchedConnection(Protocol):
    """What the middleware needs of a watched connection (peer_conn.GuardedProtocol)."""

    def request_started(self) -> None: ...

    def request_ended(self) -> None: ...


try:
    from termios import TIOCOUTQ  # == SIOCOUTQ for sockets on Linux
except ImportError:  # pragma: no cover - not on Windows
    TIOCOUTQ = None


LINGERING_S = 2.0


@dataclass
class PeerLimits:
    header_timeout_s: float = 10.0  # accept (or a later request's first byte) -> headers complete
    body_timeout_s: float = 10.0  # headers complete -> whole body read
    slow_reader_bytes: int = 1024 * 1024  # output queued for one peer before its stream is ended
    keepalive_timeout_s: float = 75.0  # idle kept-alive connection (aiohttp's own timer)

    def validate(self) -> PeerLimits:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise TierguardError(f"{name} must be a positive number of seconds, got {v!r}")
        v = self.slow_reader_bytes
        if isinstance(v, bool) or not isinstance(v, int) or v < 4096:
            raise TierguardError(f"slow_reader_bytes must be a whole number >= 4096, got {v!r}")
        return self


@dataclass
class EdgeCounters:
    """Work refused or cut off at the edge of a server; exported by `EdgeCollector`."""

    header_timeouts: int = 0
    body_timeouts: int = 0
    slow_readers: int = 0
    too_large: int = 0  # bodies over the limit (413)
    byte_rule_refusals: int = 0  # prompts refused by the byte rule before tokenizing
    malformed: int = 0  # requests that were not valid HTTP (aiohttp answered 400)
    open_connections: int = 0


class SlowReader(ConnectionResetError):
    """The peer let more than the high-water mark of output pile up; its stream was ended."""


class BodyError(Exception):
    """A body that is too large (413) or too slow (408); `message` names the limit."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PeerGuard:
    """One per server: the limits, the counters, and the connections it watches."""

    def __init__(self, limits: PeerLimits | None = None) -> None:
        self.limits = (limits or PeerLimits()).validate()
        self.counters = EdgeCounters()
        self.conns: dict[asyncio.BaseTransport, WatchedConnection] = {}  # filled by peer_conn

    # -- headers ------------------------------------------------------------------------
    def middleware(self):
        """Outermost middleware: a handler runs once the headers are in, so the timer stops."""

        @web.middleware
        async def headers_complete(request: web.Request, handler):
            conn = self.conns.get(request.transport) if request.transport is not None else None
            if conn is not None:
                conn.request_started()
            try:
                return await handler(request)
            finally:
                if conn is not None:
                    conn.request_ended()

        return headers_complete

    # -- bodies ---------------------------------------------------------------------------
    async def read_body(self, request: web.Request, max_bytes: int) -> bytes:
        """The whole body within `max_bytes` and the body timeout; BodyError otherwise."""
        if request.content_length is not None and request.content_length > max_bytes:
            self.counters.too_large += 1
            raise BodyError(413, _too_large(request.content_length, max_bytes))
        timeout_s = self.limits.body_timeout_s
        parts, size = [], 0
        try:
            async with asyncio.timeout(timeout_s):
                while chunk := await request.content.read(1 << 16):  # b"" at end of body
                    size += len(chunk)
                    if size > max_bytes:
                        self.counters.too_large += 1
                        raise BodyError(413, _too_large(size, max_bytes, at_least=True))
                    parts.append(chunk)
        except TimeoutError:
            self.counters.body_timeouts += 1
            raise BodyError(408, f"request body not received within {timeout_s:g} s "
                                 f"(got {size} bytes); send it faster or in one piece") from None
        return b"".join(parts)

    # -- streams --------------------------------------------------------------------------
    def backlog(self, request: web.Request) -> Backlog | None:
        """A slow-reader check for one streamed response (None when the peer is gone)."""
        transport = request.transport
        return None if transport is None else Backlog(self, transport)


def _too_large(size: int, limit: int, at_least: bool = False) -> str:
    return (f"request body is {'over ' if at_least else ''}{size} bytes; this server accepts at most {limit} "
            f"(it follows from max_model_len; see --max-body-bytes)")


async def expect_json(request: web.Request) -> web.StreamResponse | None:
    """Routes' `expect_handler`: aiohttp's own one (100 Continue), but an unknown
    expectation gets a JSON 417 like every other refusal instead of a plain-text one.
    (aiohttp runs it before any middleware, so the middlewares cannot reshape it.)"""
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1):
        return None
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started (as aiohttp does)
        return None
    resp = web.json_response({"error": {"message": f"unknown Expect: {expect[:100]}; only 100-continue is "
                                                   f"supported", "type": "expectation_failed", "param": None,
                                        "code": 417}}, status=417)
    resp.force_close()
    return resp


class Backlog:
    """Bytes queued for one peer, checked before each write of a stream."""

    __slots__ = ("_guard", "_transport", "_fd", "_limit")

    def __init__(self, guard: PeerGuard, transport: asyncio.BaseTransport) -> None:
        self._guard = guard
        self._transport = transport
        self._limit = guard.limits.slow_reader_bytes
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None and TIOCOUTQ is not None else -1
        # The writer must not wait in drain() below our own mark, or the check never runs again.
        with contextlib.suppress(AttributeError, NotImplementedError):
            transport.set_write_buffer_limits(high=4 * self._limit + (1 << 20))  # type: ignore[attr-defined]

    def queued(self) -> int:
        n = self._transport.get_write_buffer_size()  # type: ignore[attr-defined]
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                n += int.from_bytes(fcntl.ioctl(self._fd, TIOCOUTQ, b"\0\0\0\0"), sys.byteorder, signed=True)
        return n

    def check(self) -> None:
        """Raise SlowReader (after aborting the connection) when the peer fell too far behind."""
        if self.queued() > self._limit:
            self._guard.counters.slow_readers += 1
            self._transport.abort()
            raise SlowReader(f"peer has more than {self._limit} bytes of output unread")


class EdgeCollector:
    """Prometheus view of `EdgeCounters` (+ the tokenizer pool), read at scrape time."""

    def __init__(self, prefix: str, guard: PeerGuard, pool=None, labels: dict[str, str] | None = None) -> None:
        self.prefix, self.guard, self.pool = prefix, guard, pool
        self.labels = labels or {}

    def _family(self, kind, name: str, doc: str, value: float):
        fam = kind(self.prefix + name, doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), value)
        return fam

    def collect(self):
        from prometheus_client.core import CounterMetricFamily as C
        from prometheus_client.core import GaugeMetricFamily as G

        c = self.guard.counters
        yield self._family(C, "http_header_timeouts", "Connections closed: headers not complete in time",
                           c.header_timeouts)
        yield self._family(C, "http_body_timeouts", "Requests refused (408): body not read in time", c.body_timeouts)
        yield self._family(C, "http_slow_readers", "Streams ended: the peer let output pile up past the "
                           "high-water mark", c.slow_readers)
        yield self._family(C, "http_body_too_large", "Requests refused (413): body over the limit", c.too_large)
        yield self._family(C, "byte_rule_refusals", "Prompts refused before tokenizing: cannot fit "
                           "max_model_len by the byte rule", c.byte_rule_refusals)
        yield self._family(C, "http_malformed", "Requests that were not valid HTTP (400 from aiohttp)", c.malformed)
        yield self._family(G, "http_open_connections", "Connections open now", c.open_connections)
        if self.pool is not None:
            s = self.pool.stats
            yield self._family(G, "tokenizer_pending", "Tokenizer jobs queued or running", s.pending)
            yield self._family(C, "tokenizer_jobs", "Tokenizer jobs sent to workers", s.submitted)
            yield self._family(C, "tokenizer_busy", "Requests refused (503): tokenizer queue full", s.rejected)
