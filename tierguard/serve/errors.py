"""OpenAI-style error bodies.

Clients written for the OpenAI API (the official SDKs, LangChain, curl scripts) read
`{"error": {"message", "type", "param", "code"}}` and map the HTTP status to an
exception class, so every failure the server reports goes through `APIError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from pydantic import ValidationError

from tierguard.common.errors import TierguardError
from tierguard.engine.api import EngineDeadError, RequestFailed
from tierguard.gate.forward import ENGINE_STATE_HEADER

# HTTP status -> OpenAI error "type" string (what the SDKs expect to see).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


@dataclass
class APIError(Exception):
    """A request the server refuses; `message` names the problem and the fix."""

    status: int
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None  # e.g. Retry-After on a 429

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def engine_error(exc: BaseException) -> APIError | None:
    """The answer to an exception from the engine's `generate` (api.AsyncEngine), or None
    for one the engine does not raise by contract (a bug: the caller lets it through).

    Refused input is a 400; a failure of this request alone a 500; a stopped engine a 503
    for a request it never started (safe to retry elsewhere) and a 500 for one it was
    serving (it may be the cause: not retried), both marked with ENGINE_STATE_HEADER so a
    gate ejects this server at once instead of at its next health probe."""
    if isinstance(exc, TierguardError):
        return bad_request(str(exc))
    if isinstance(exc, RequestFailed):
        return APIError(500, f"{exc}; the server log has the details")
    if isinstance(exc, EngineDeadError):
        if exc.started:
            return APIError(500, f"the engine stopped while serving this request ({exc})", None, dead_header())
        return APIError(503, f"this server cannot generate: {exc}; it must be restarted", None, dead_header())
    return None


def dead_header() -> dict[str, str]:
    return {ENGINE_STATE_HEADER: "dead"}


def from_validation_error(exc: ValidationError) -> APIError:
    """Turn pydantic's report into one readable line: `field: what was wrong; ...`.

    Malformed JSON arrives here too (pydantic parses the raw body), so a syntax error
    and a wrong type both become a 400 with the same body shape.
    """
    parts: list[str] = []
    first_param: str | None = None
    for err in exc.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        if err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            continue
        first_param = first_param or (loc or None)
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return APIError(400, "; ".join(parts) or "invalid request", first_param)
