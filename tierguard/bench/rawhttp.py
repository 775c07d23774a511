"""A minimal HTTP/1.1 streaming client on asyncio protocols, for plain-http servers.

Why not aiohttp here: with hundreds of streams, aiohttp's per-chunk path (parser, stream
reader, waking the reading task) costs several times more CPU than the bytes need, and
every timestamp is taken only when the reading task gets its turn. Here the timestamp is
taken in `data_received`, the moment the event loop hands over the bytes, and no task
wakes per chunk. Scope: POST with a JSON body, keep-alive, `chunked` or `Content-Length`
or close-delimited bodies. TLS (https) goes through aiohttp instead (backend.py).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from tierguard.bench.records import RequestRecord
from tierguard.bench.sse import SSEAccumulator


class ConnectFailed(Exception):
    """TCP connection could not be opened (message says why)."""


class TransportFailed(Exception):
    """The connection broke before the response was complete."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; `handler` receives bytes while a request is active."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.handler: _Response | None = None
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        h = self.handler
        if h is not None:
            h.on_data(data)

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.handler is not None:
            self.handler.on_lost()

    def eof_received(self):
        return False  # close our side too


class _Response:
    """Parses one response (head, then body framing) and feeds the body to `acc`."""

    def __init__(self, acc: SSEAccumulator | None, t0: float, fut: asyncio.Future) -> None:
        self.acc, self.t0, self.fut = acc, t0, fut
        self.head = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body_mode = ""  # "chunked" | "length" | "close"
        self.remaining = 0  # chunked: bytes left in the current chunk; length: bytes left in body
        self.need_crlf = False
        self.cbuf = b""
        self.error_body = b""
        self.got_bytes = False
        self.keep_alive = True

    def on_data(self, data: bytes) -> None:
        try:
            self._on_data(data)
        except ValueError as exc:  # bad status line, chunk size or Content-Length: a broken server
            self.keep_alive = False
            if not self.fut.done():
                self.fut.set_exception(TransportFailed(f"malformed HTTP response from the server: {exc}"))

    def _on_data(self, data: bytes) -> None:
        now = time.monotonic() - self.t0
        self.got_bytes = True
        if not self.status:
            self.head += data
            i = self.head.find(b"\r\n\r\n")
            if i < 0:
                return
            self._parse_head(self.head[:i], now)
            data = self.head[i + 4:]
            self.head = b""
            if not data:
                return
        if self.body_mode == "chunked":
            data, finished = self._dechunk(data)
        elif self.body_mode == "length":
            data = data[: self.remaining]
            self.remaining -= len(data)
            finished = self.remaining <= 0
        else:
            finished = False
        if data:
            if self.status == 200 and self.acc is not None:
                self.acc.feed(data, now)
            elif len(self.error_body) < 8192:
                self.error_body += data
        if finished and not self.fut.done():
            self.fut.set_result(now)

    def on_lost(self) -> None:
        self.keep_alive = False
        if self.fut.done():
            return
        if self.status and self.body_mode == "close":
            self.fut.set_result(time.monotonic() - self.t0)
        else:
            self.fut.set_exception(TransportFailed("server closed the connection mid-response"
                                                   if self.got_bytes else "server closed the connection"))

    def _parse_head(self, head: bytes, now: float) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        self.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 599
        for line in lines[1:]:
            k, _, v = line.partition(":")
            self.headers[k.strip().lower()] = v.strip()
        te = self.headers.get("transfer-encoding", "").lower()
        if "chunked" in te:
            self.body_mode = "chunked"
        elif "content-length" in self.headers:
            self.body_mode, self.remaining = "length", int(self.headers["content-length"])
        else:
            self.body_mode = "close"
        if self.headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self.keep_alive = False
        if self.acc is not None:
            self.acc.rec.headers_s = now
        if self.body_mode == "length" and self.remaining == 0 and not self.fut.done():
            self.fut.set_result(now)

    def _dechunk(self, data: bytes) -> tuple[bytes, bool]:
        """Strip `chunked` framing incrementally; returns (payload, body finished)."""
        buf = self.cbuf + data if self.cbuf else data
        pos, n, out = 0, len(buf), []
        while pos < n:
            if self.remaining:
                take = min(self.remaining, n - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self.remaining -= take
                if not self.remaining:
                    self.need_crlf = True
                continue
            if self.need_crlf:
                if n - pos < 2:
                    break
                pos += 2
                self.need_crlf = False
                continue
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(buf[pos:nl].split(b";", 1)[0], 16)
            if size == 0:  # last chunk: an empty line (or trailers and an empty line) ends the body
                end = buf.find(b"\r\n", nl + 2) if buf[nl + 2:nl + 4] == b"\r\n" else buf.find(b"\r\n\r\n", nl + 2)
                if end < 0:
                    break
                self.cbuf = b""
                return b"".join(out), True
            pos = nl + 2
            self.remaining = size
        self.cbuf = buf[pos:]
        return (out[0] if len(out) == 1 else b"".join(out)), False


class RawClient:
    """Streams POSTs to one host over a pool of keep-alive connections."""

    def __init__(self, base_url: str, connect_timeout_s: float = 10.0) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self.host_header = f"{self.host}:{self.port}"
        self.idle: list[_Conn] = []
        self.connect_timeout = connect_timeout_s

    async def _connect(self) -> tuple[_Conn, float]:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port), self.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"connection to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from None
        return conn, (time.monotonic() - start) * 1000.0

    async def preconnect(self, n: int) -> int:
        results = await asyncio.gather(*[self._connect() for _ in range(n)], return_exceptions=True)
        conns = [r[0] for r in results if isinstance(r, tuple)]
        self.idle.extend(conns)
        return len(conns)

    def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()
        self.idle.clear()

    async def stream(self, path: str, body: bytes, headers: dict[str, str], acc: SSEAccumulator | None,
                     rec: RequestRecord, t0: float, timeout_s: float) -> tuple[int, str, float, str]:
        """Send one request; returns (status, error body text, end time, content type)."""
        head = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}", f"Content-Length: {len(body)}",
                "Accept: text/event-stream"] + [f"{k}: {v}" for k, v in headers.items()]
        payload = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        for attempt in (0, 1):
            reused = False
            conn = None
            while self.idle:
                c = self.idle.pop()
                if not c.lost and c.transport is not None and not c.transport.is_closing():
                    conn, reused = c, True
                    break
            if conn is None:
                conn, ms = await self._connect()
                rec.connect_ms = ms
            fut = asyncio.get_running_loop().create_future()
            resp = _Response(acc, t0, fut)
            conn.handler = resp
            conn.transport.write(payload)
            try:
                end = await asyncio.wait_for(fut, timeout_s)
            except TransportFailed:
                conn.handler = None
                if reused and not resp.got_bytes and attempt == 0:
                    continue  # a stale keep-alive connection: the server never saw the request
                raise
            except BaseException:
                conn.handler = None
                conn.transport.close()  # timeout or cancellation: the connection is in an unknown state
                raise
            conn.handler = None
            if resp.keep_alive and not conn.lost:
                self.idle.append(conn)
            else:
                conn.transport.close()
            rec.http_status = resp.status
            return (resp.status, resp.error_body.decode("utf-8", "replace"), end,
                    resp.headers.get("content-type", ""))
        raise TransportFailed("server closed the connection")
