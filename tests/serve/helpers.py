"""Shared test helpers: an in-process server (or gate) on an ephemeral loopback port, SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[TestClient]:
    """Run `app` on 127.0.0.1:<ephemeral> with handler cancellation, as the CLI does."""
    server = TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True)
    client = TestClient(server)
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def gate(upstreams: list[str], jobs_dir: str, **settings) -> AsyncIterator[TestClient]:
    """A real gate (`build_app`, as the CLI builds it) in this process, in front of `upstreams`."""
    from tierguard.gate.app import build_app
    from tierguard.gate.policy import GateSettings

    config = GateSettings(upstream=upstreams[0], upstreams=list(upstreams), jobs_dir=jobs_dir, **settings)
    async with serve(build_app(config.validate())) as client:
        yield client


def url_of(client: TestClient) -> str:
    return str(client.make_url("")).rstrip("/")


def parse_sse(raw: str) -> tuple[list[dict], bool]:
    """(json events, whether the stream ended with [DONE])."""
    events, done = [], False
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
