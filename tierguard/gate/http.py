"""HTTP edges of the gate: OpenAI-style errors, bounded body reads, API-key checks.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and honour
`Retry-After` on 429, so every refusal goes through `error_response`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from aiohttp import web

PUBLIC_PATHS = ("/health", "/metrics")


def error_response(status: int, message: str, etype: str = "invalid_request_error",
                   retry_after_s: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    headers = {"Retry-After": str(int(retry_after_s))} if retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)


async def read_json(request: web.Request, max_bytes: int, timeout_s: float) -> dict:
    """Read and parse the body within a size limit and a deadline.

    Raises HTTPRequestEntityTooLarge (413), HTTPRequestTimeout (408) or HTTPBadRequest
    (400); the caller turns them into OpenAI-style errors.
    """
    if request.content_length is not None and request.content_length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=request.content_length,
                                            text=f"request body over the limit of {max_bytes} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            parts, size = [], 0
            while chunk := await request.content.read(1 << 16):  # b"" at end of body
                size += len(chunk)
                if size > max_bytes:
                    raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=size,
                                                        text=f"request body over the limit of {max_bytes} bytes")
                parts.append(chunk)
            raw = b"".join(parts)
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"request body not received within {timeout_s:g} s") from None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="malformed JSON body") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def key_matches(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every key (no early exit reveals which matched)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def auth_middleware(keys: list[str], on_refused: Callable[[web.Request], None] | None = None):
    """401 without a valid key; `on_refused(request)` records the refusal (request log)."""

    @web.middleware
    async def check(request: web.Request, handler):
        if keys and request.path not in PUBLIC_PATHS:
            auth = request.headers.get("Authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not key_matches(token, keys):
                if on_refused is not None:
                    on_refused(request)
                return error_response(401, "missing or invalid API key", etype="authentication_error")
        return await handler(request)

    return check
