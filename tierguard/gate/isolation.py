"""Prefix-cache isolation between tenants: the `cache_salt` the gate sends upstream.

Engines share cached KV between requests whose prompts start alike, and a shared cache
tells: a request that hits is faster, `cached_tokens` counts the hit. vLLM partitions
its prefix cache by a request's `cache_salt` (completions and chat completions), and so
do `tierguard serve` and the TierguardConnector, in every tier (device, host RAM, disk,
Redis). The gate chooses the salt:

- `shared` (default): requests are forwarded as they came; a client's own `cache_salt`
  passes through, and every client without one shares one cache.
- `per-key`: every request carries a salt derived from its API key (SHA-256 of the key,
  so it is stable across gates and restarts and cannot be guessed without the key). A
  client's own `cache_salt` only splits its key's partition further (it is appended as a
  digest), never reaches another key's. The gate's prefix routing index is kept per salt
  too (prefix_index.py), so where a request goes depends on its own key's traffic only.
"""

from __future__ import annotations

import hashlib

from tierguard.common.errors import TierguardError

MODES = ("shared", "per-key")
SALT_FIELD = "cache_salt"
_TAG = b"tierguard cache salt\x00"


def key_salt(api_key: str) -> str:
    """The salt of every request made with `api_key` under `per-key` isolation."""
    return "tgk-" + hashlib.sha256(_TAG + api_key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def bearer_key(authorization: str) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" when there is none)."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""


def apply_salt(body: dict, mode: str, api_key: str) -> None:
    """Set `body`'s `cache_salt` for `mode` (in place). Raises TierguardError (a 400) for
    a client salt that is not a non-empty string under `per-key`."""
    if mode == "shared":
        return
    if mode != "per-key":
        raise ValueError(f"unknown cache isolation {mode!r}")
    salt = key_salt(api_key)
    own = body.get(SALT_FIELD)
    if own is not None:
        if not isinstance(own, str) or not own:
            raise TierguardError("'cache_salt' must be a non-empty string")
        salt += "." + hashlib.sha256(own.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    body[SALT_FIELD] = salt


def check_mode(mode: object, has_keys: bool) -> None:
    if mode not in MODES:
        raise TierguardError(f"--cache-isolation must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "per-key" and not has_keys:
        raise TierguardError("--cache-isolation per-key needs API keys (--api-key or --api-key-file)")
