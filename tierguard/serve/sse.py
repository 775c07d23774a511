"""Server-sent events in the shape OpenAI clients parse: `data: {json}\\n\\n` … `data: [DONE]`.

A write to a client that went away raises `ClientGone`, so the handler has one
exception to catch and can abort the engine request (freeing its KV blocks) instead
of generating tokens nobody will read. A client that is there but does not read (its
unread output passed the slow-reader mark, `common/peers.py`) ends the same way.
"""

from __future__ import annotations

import json

from aiohttp import web

from tierguard.common.peers import Backlog

_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The peer closed the connection while we were streaming to it."""


class SSEWriter:
    def __init__(self, request: web.Request, backlog: Backlog | None = None) -> None:
        self._request = request
        self._backlog = backlog
        self._resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )

    @property
    def response(self) -> web.StreamResponse:
        return self._resp

    def client_gone(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    async def open(self) -> None:
        await self._resp.prepare(self._request)

    async def send(self, body: dict) -> None:
        await self._write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    async def done(self) -> None:
        await self._write(_DONE)
        await self._resp.write_eof()

    async def _write(self, data: bytes) -> None:
        if self.client_gone():
            raise ClientGone()
        try:
            if self._backlog is not None:
                self._backlog.check()  # raises SlowReader, a ConnectionResetError
            await self._resp.write(data)
        except (ConnectionResetError, ConnectionError, RuntimeError) as exc:
            # aiohttp raises ClientConnectionResetError (a ConnectionResetError) or
            # RuntimeError("Cannot write to closing transport") depending on timing.
            raise ClientGone() from exc
