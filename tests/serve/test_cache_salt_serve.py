"""`cache_salt` and `cached_tokens` at serve's API, on the real tiny engine in process:
cached tokens are reported only with `--enable-prompt-tokens-details`; a request's
`cache_salt` partitions the prefix cache (no hit across salts, vLLM's semantics); a bad
salt is a 400 naming it."""

from __future__ import annotations

import asyncio

import pytest

from tierguard.serve.app import create_app

from .helpers import serve

BODY = {"model": "tiny", "prompt": list(range(10, 74)), "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    return AsyncLLMEngine.from_model_dir(
        ensure_tiny_model(), model_name="tiny", max_model_len=256, kv_cache_gib=0.02, dtype="float32", device="cpu"
    )


def _post_all(engine, bodies: list[dict], **app) -> list[tuple[int, dict, int]]:
    """(status, body, prefix-cache hit tokens so far) per request, in order."""

    async def go():
        out = []
        async with serve(create_app(engine, **app)) as client:
            for body in bodies:
                r = await client.post("/v1/completions", json=body)
                out.append((r.status, await r.json(), engine.engine.block_manager.prefix_hits))
        return out

    return asyncio.run(go())


def test_cached_tokens_only_with_the_flag(engine):
    (_, _, h0), (_, quiet, h1) = _post_all(engine, [BODY, BODY])
    assert h1 > h0 and "prompt_tokens_details" not in quiet["usage"]  # a hit, not told
    ((_, told, _),) = _post_all(engine, [BODY], prompt_tokens_details=True)
    assert told["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48


def test_cache_salt_partitions_the_prefix_cache(engine):
    salted = [{**BODY, "prompt": list(range(90, 154)), "cache_salt": s} for s in ("a", "b", "a")]
    (_, _, h0), (_, _, h1), (_, _, h2) = _post_all(engine, salted)
    assert h1 == h0 and h2 > h1  # salt b: no hit on a's prefix; a again: its own
    for bad in ("", 7):
        ((status, err, _),) = _post_all(engine, [{**BODY, "cache_salt": bad}])
        assert status == 400 and "cache_salt" in err["error"]["message"], err
