"""The connection side of `peers.py`: aiohttp's protocol wrapped with a header deadline.

`GuardedRunner` is a `web.AppRunner` whose protocol factory wraps every connection in
`GuardedProtocol`; everything else is passed to aiohttp unchanged. `_make_server` is
BaseRunner's extension point (AppRunner and ServerRunner override it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tierguard.common.peers import LINGERING_S, EdgeCounters, PeerGuard


def guarded_runner(guard: PeerGuard, app: web.Application, **kwargs) -> web.AppRunner:
    """An AppRunner whose connections `guard` watches; `keepalive_timeout` from its limits."""
    kwargs.setdefault("keepalive_timeout", guard.limits.keepalive_timeout_s)
    # After a refused body (408/413), aiohttp reads and drops the rest for up to this long
    # before closing, so the client sees the answer rather than a reset (its default is 10 s).
    kwargs.setdefault("lingering_time", LINGERING_S)
    kwargs.setdefault("logger", ServerLog(guard.counters))
    return GuardedRunner(app, guard, **kwargs)


class GuardedRunner(web.AppRunner):
    """`web.AppRunner` whose protocol factory wraps every connection in `GuardedProtocol`."""

    def __init__(self, app: web.Application, guard: PeerGuard, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self):
        return _GuardedFactory(await super()._make_server(), self.guard)


class _GuardedFactory:
    def __init__(self, server, guard: PeerGuard) -> None:
        self._server = server
        self._guard = guard

    def __call__(self) -> GuardedProtocol:
        return GuardedProtocol(self._server(), self._guard)

    def __getattr__(self, name: str):
        return getattr(self._server, name)


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's RequestHandler plus a header deadline; every callback is passed on."""

    def __init__(self, inner: asyncio.Protocol, guard: PeerGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = 0  # requests whose headers are in and whose handler runs

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._guard.conns[transport] = self
        self._guard.counters.open_connections += 1
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy and self._timer is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._guard.conns.pop(self._transport, None) is not None:  # type: ignore[arg-type]
            self._guard.counters.open_connections -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def request_started(self) -> None:
        self._busy += 1
        self._cancel()

    def request_ended(self) -> None:
        self._busy -= 1

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.limits.header_timeout_s, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        t = self._transport
        if self._busy or t is None or t.is_closing():
            return
        self._guard.counters.header_timeouts += 1
        s = self._guard.limits.header_timeout_s
        body = json.dumps({"error": {"message": f"request headers not received within {s:g} s",
                                     "type": "request_timeout", "param": None, "code": 408}}).encode()
        head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(Exception):  # the peer may be gone already; closing is what matters
            t.write(head + body)
        t.close()
        asyncio.get_running_loop().call_later(1.0, t.abort)  # a peer that reads nothing cannot hold it


class ServerLog(logging.LoggerAdapter):
    """aiohttp.server's logger, minus the traceback aiohttp logs for every malformed request.

    A request that is not valid HTTP is the client's problem, already answered with 400:
    it is counted and logged as one line at INFO, not as an ERROR with a traceback. Any
    other exception is logged exactly as aiohttp would."""

    def __init__(self, counters: EdgeCounters) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.counters = counters

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            self.counters.malformed += 1
            first = str(exc.message).strip().splitlines()[0] if exc.message else type(exc).__name__
            self.logger.info("malformed request (%d): %s", exc.code, first[:200])
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)
