"""Before the clock starts: is the server there, which model, which quirks?

One tiny streaming request finds out whether the endpoint exists, streams SSE, accepts
our optional fields, sends usage and `[DONE]`. Problems that would make every request
fail (unreachable, 404, 5xx, not SSE) become one clear `TierguardError` here instead of
thousands of identical failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp

from tierguard.bench.backend import OpenAIBackend, Quirks, open_client
from tierguard.bench.config import BenchConfig
from tierguard.bench.records import RequestRecord
from tierguard.common.errors import TierguardError


@dataclass
class Preflight:
    model: str
    quirks: Quirks


async def _resolve_model(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    url = cfg.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=cfg.auth_headers) as resp:
            if resp.status == 200:
                data = await resp.json(content_type=None)
                models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
                if models and models[0]:
                    return str(models[0])
    except aiohttp.ClientConnectorError as exc:
        raise TierguardError(f"cannot reach server at {cfg.base_url}: {exc.os_error or exc}") from None
    except (aiohttp.ClientError, ValueError, AttributeError, asyncio.TimeoutError):
        pass
    raise TierguardError(f"no --model given and {url} did not list one; pass --model NAME")


async def preflight(cfg: BenchConfig) -> Preflight:
    timeout = aiohttp.ClientTimeout(total=min(cfg.timeout, 60.0), sock_connect=10.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = cfg.model or await _resolve_model(session, cfg)
    backend = OpenAIBackend(cfg.endpoint, model, cfg.api_key, cfg.ignore_eos, cfg.temperature, min(cfg.timeout, 60.0))
    rec = RequestRecord(index=0)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    async with contextlib.AsyncExitStack() as stack:
        client = await open_client(stack, cfg.base_url, cfg.http_client)
        await backend.send(client, "Hello", 4, rec, time.monotonic())
    if rec.ok:
        return Preflight(model, backend.quirks)
    err = rec.error or "unknown error"
    if err.startswith("cannot connect"):
        raise TierguardError(f"cannot reach server at {cfg.base_url}: {err.removeprefix('cannot connect: ')}")
    if rec.http_status == 404:
        raise TierguardError(f"{url} answered HTTP 404: wrong --endpoint or --base-url? ({err})")
    raise TierguardError(f"probe request to {url} failed: {err}")
