"""The HTTP side: send one OpenAI-compatible streaming completion and time its chunks.

Kept apart from scheduling (strategy.py, worker.py): `OpenAIBackend.send` fills a
`RequestRecord` and never decides when to send. Two transports share one interface
(`stream(path, body, headers, acc, rec, t0, timeout) -> (status, error text, end, content
type)`): `RawClient` (rawhttp.py) for http:// — cheapest per chunk, timestamps taken as
bytes arrive — and `AiohttpClient` for https:// and anything RawClient does not speak.

Quirks: servers that end without `[DONE]` (end of body ends the stream), that send no
usage (tokens counted later from text), and that reject unknown fields such as
`ignore_eos` with 400/422 (the request is retried without the field, the drop is
recorded on the request and remembered for later requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import aiohttp

from tierguard.bench.rawhttp import ConnectFailed, RawClient, TransportFailed
from tierguard.bench.records import FAILED, REJECTED, TIMEOUT, RequestRecord
from tierguard.bench.sse import SSEAccumulator, error_message, resolve_token_counts

__all__ = ["AiohttpClient", "OpenAIBackend", "Quirks", "make_client", "open_client", "resolve_token_counts"]
OPTIONAL_FIELDS = ("ignore_eos", "continuous_usage_stats", "stream_options")


@dataclass
class Quirks:
    """What this server does not accept or send; shared by all requests of a worker."""

    dropped_fields: list[str] = field(default_factory=list)
    sends_done: bool | None = None
    sends_usage: bool | None = None
    continuous_usage: bool | None = None


class AiohttpClient:
    """The same `stream` interface over an aiohttp session (TLS, proxies, odd servers)."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AiohttpClient:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[_trace_config()])
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()

    async def preconnect(self, n: int) -> int:
        return 0  # aiohttp pools connections itself; set-up is reported per request

    def close(self) -> None:
        pass

    async def stream(self, path, body, headers, acc, rec, t0, timeout_s):
        ctx: dict = {}
        mono = time.monotonic
        try:
            async with self.session.post(self.base + path, data=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s), trace_request_ctx=ctx) as resp:
                rec.headers_s = mono() - t0
                rec.connect_ms = ctx.get("connect_ms")
                rec.http_status = resp.status
                ctype = resp.headers.get("Content-Type", "")
                if resp.status != 200:
                    text = (await resp.content.read(8192)).decode("utf-8", "replace")
                    return resp.status, text, mono() - t0, ctype
                async for data in resp.content.iter_any():
                    if acc.feed(data, mono() - t0):
                        break
                return 200, "", mono() - t0, ctype
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(str(exc.os_error or exc)) from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise TransportFailed(f"{type(exc).__name__}: {exc}") from None


def _trace_config() -> aiohttp.TraceConfig:
    """Connection set-up timing for aiohttp, reported apart from TTFT."""
    tc = aiohttp.TraceConfig()

    async def start(_s, ctx, _p) -> None:
        if ctx.trace_request_ctx is not None:
            ctx.trace_request_ctx["c0"] = time.monotonic()

    async def end(_s, ctx, _p) -> None:
        d = ctx.trace_request_ctx
        if d is not None and "c0" in d:
            d["connect_ms"] = (time.monotonic() - d["c0"]) * 1000.0

    tc.on_connection_create_start.append(start)
    tc.on_connection_create_end.append(end)
    return tc


def make_client(base_url: str, kind: str = "auto"):
    """RawClient for plain http (the fast path), aiohttp for https or when asked for."""
    return RawClient(base_url) if kind == "auto" and base_url.startswith("http://") else AiohttpClient(base_url)


async def open_client(stack: contextlib.AsyncExitStack, base_url: str, kind: str = "auto"):
    """`make_client`, entered on `stack`: closed (an aiohttp session shut too) when it unwinds."""
    client = make_client(base_url, kind)
    if isinstance(client, AiohttpClient):
        await stack.enter_async_context(client)
    stack.callback(client.close)
    return client


class OpenAIBackend:
    def __init__(self, endpoint: str, model: str, api_key: str | None, ignore_eos: bool, temperature: float,
                 timeout_s: float, quirks: Quirks | None = None) -> None:
        self.path = endpoint
        self.chat = endpoint.endswith("/chat/completions")
        self.model, self.ignore_eos, self.temperature, self.timeout_s = model, ignore_eos, temperature, timeout_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.quirks = quirks or Quirks()

    def payload(self, prompt: str, max_tokens: int) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "stream": True, "temperature": self.temperature}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        dropped = self.quirks.dropped_fields
        if "stream_options" not in dropped:
            opts = {"include_usage": True}
            if "continuous_usage_stats" not in dropped:
                opts["continuous_usage_stats"] = True
            body["stream_options"] = opts
        if self.ignore_eos and "ignore_eos" not in dropped:
            body["ignore_eos"] = True
        return body

    async def send(self, client, prompt: str, max_tokens: int, rec: RequestRecord, t0: float) -> None:
        """Send, stream and time one request into `rec`; server faults end up in `rec`, not raised."""
        for _ in range(len(OPTIONAL_FIELDS) + 1):
            if not await self._once(client, prompt, max_tokens, rec, t0):
                return

    async def _once(self, client, prompt: str, max_tokens: int, rec: RequestRecord, t0: float) -> bool:
        """One attempt; True when it should be retried without a field the server rejected."""
        body = json.dumps(self.payload(prompt, max_tokens)).encode()
        rec.chunk_times_s.clear()
        rec.chunk_tokens.clear()
        acc = SSEAccumulator(rec)
        rec.sent_s = time.monotonic() - t0
        try:
            status, text, end, ctype = await client.stream(self.path, body, self.headers, acc, rec, t0, self.timeout_s)
        except asyncio.TimeoutError:
            rec.status, rec.error, rec.end_s = TIMEOUT, f"request timed out after {self.timeout_s:g} s", time.monotonic() - t0
            return False
        except ConnectFailed as exc:
            rec.status, rec.error, rec.end_s = FAILED, f"cannot connect: {exc}", time.monotonic() - t0
            return False
        except TransportFailed as exc:
            rec.status, rec.error, rec.end_s = FAILED, str(exc), time.monotonic() - t0
            return False
        if status != 200:
            return self._http_error(status, text, rec, end)
        acc.finish(end, ctype)
        q = self.quirks
        q.sends_done = bool(q.sends_done) or acc.end is not None and not acc.failed
        if acc.usage_total is not None or acc.last_ct:
            q.sends_usage = True
        elif q.sends_usage is None and rec.ok:
            q.sends_usage = False
        if acc.last_ct:
            q.continuous_usage = True
        return False

    def _http_error(self, status: int, text: str, rec: RequestRecord, end: float) -> bool:
        if status in (400, 422):
            for name in OPTIONAL_FIELDS:
                if name not in self.quirks.dropped_fields and name in text:
                    self.quirks.dropped_fields.append(name)
                    rec.retried_without.append(name)
                    return True
        rec.status = REJECTED if status == 429 else FAILED
        rec.error = f"HTTP {status}: {error_message(text)}"
        rec.end_s = end
        return False
