"""HTTP edges of the gate: OpenAI-style errors, bounded body reads, API-key checks, tenants.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and honour
`Retry-After` on 429, so every refusal goes through `error_response`.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from aiohttp import web

from tierguard.common.peers import BodyError, PeerGuard
from tierguard.gate.jobs import owner_id

PUBLIC_PATHS = ("/health", "/metrics")


def error_response(status: int, message: str, etype: str = "invalid_request_error",
                   retry_after_s: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    headers = {"Retry-After": str(int(retry_after_s))} if retry_after_s is not None else None
    return web.json_response(body, status=status, headers=headers)


async def read_json(request: web.Request, guard: PeerGuard, max_bytes: int) -> dict:
    """Read and parse the body within a size limit and the guard's deadline.

    Raises BodyError: 413 (too large), 408 (too slow) or 400 (not a JSON object).
    """
    raw = await guard.read_body(request, max_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BodyError(400, "malformed JSON body") from None
    except RecursionError:  # the parser's own depth guard: thousands of nested [ or {
        raise BodyError(400, "the JSON body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BodyError(400, "the body must be a JSON object")
    return body


_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def messages_problem(messages: object) -> str | None:
    """Why a chat body's `messages` cannot be served, or None: a non-empty array of objects,
    each with a string `role` and a `content` that is a string, an array of part objects,
    or null (an assistant turn with tool calls). Checked before counting, so every later
    step may rely on the shape."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with 'role' and 'content', got {_JSON_TYPE.get(type(m), 'a value')}"
        if not isinstance(m.get("role"), str):
            return f"messages[{i}].role must be a string"
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"messages[{i}].content must be a string or a list of parts, got {_JSON_TYPE.get(type(content))}"
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    return f"messages[{i}].content[{j}] must be an object (a content part)"
    return None


def key_matches(presented: str, keys: list[str]) -> bool:
    """Constant-time comparison against every key (no early exit reveals which matched)."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def json_errors_middleware():
    """aiohttp's own refusals (no such route, wrong method) in the same JSON shape as ours."""

    @web.middleware
    async def json_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            msg = "no such route" if exc.status == 404 else exc.reason
            return error_response(exc.status, f"{request.method} {request.path}: {msg}")

    return json_errors


def _bearer(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def tenant(request: web.Request, keys: list[str]) -> str | None:
    """Who owns what this request creates: owner_id() of its API key (already checked by
    auth_middleware), or None when the gate has no keys."""
    return owner_id(_bearer(request)) if keys else None


def auth_middleware(keys: list[str], on_refused: Callable[[web.Request], None] | None = None):
    """401 without a valid key on every path but /health and /metrics; `on_refused(request)`
    records the refusal (request log)."""

    @web.middleware
    async def check(request: web.Request, handler):
        if keys and request.path not in PUBLIC_PATHS and not key_matches(_bearer(request), keys):
            if on_refused is not None:
                on_refused(request)
            return error_response(401, "missing or invalid API key", etype="authentication_error")
        return await handler(request)

    return check
