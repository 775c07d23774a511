"""The remote KV tier against a real redis-server that wants a password (requirepass, an ACL
user) or TLS (with a client certificate): it connects, stores and reads blocks; with the
wrong password it is a degraded tier, never an error; and the password appears in no log
line, error, reason or /health field."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.kv.conftest import FP, payload
from tierguard.common.errors import TierguardError
from tierguard.common.redis_server import RedisServer
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.remote.tier import RemoteTier

BLOCK = 4096
SECRET = "s3cret-Pa55word"


def _blocks(*hashes: int) -> list[tuple[int, bytes]]:
    return [(h, payload(h, BLOCK).numpy().tobytes()) for h in hashes]


@pytest.fixture(params=["requirepass", "acl", "tls_acl_client_cert"])
def secured(request, redis_server):  # redis_server: skips where the package is missing
    kw = {"requirepass": {"password": SECRET}, "acl": {"user": ("tg", SECRET)},
          "tls_acl_client_cert": {"user": ("tg", SECRET), "tls_client_auth": True}}[request.param]
    server = RedisServer(**kw).start()
    yield server
    server.stop()


def test_the_remote_tier_connects_with_auth_and_tls(secured, caplog):
    caplog.set_level(logging.DEBUG)
    assert SECRET in secured.url
    tier = RemoteTier(secured.url, FP, BLOCK, 64 * (blk.HEADER_LEN + BLOCK), timeout_ms=2000, refresh_s=0.05)
    try:
        assert tier.write_many(_blocks(1, 2)) == [True, True]
        got = [(h, bytearray(BLOCK)) for h in (1, 2)]
        assert tier.read_many(got) == [True, True]
        assert [bytes(b) for _, b in got] == [d for _, d in _blocks(1, 2)]
        assert tier.healthy and tier.stats().errors == 0
        assert SECRET not in tier.url and "***" in tier.url
    finally:
        tier.close()
    assert SECRET not in caplog.text


def test_a_wrong_password_is_a_degraded_tier_and_is_never_shown(redis_server, caplog):
    caplog.set_level(logging.DEBUG)
    with RedisServer(password=SECRET, tls=True) as server:
        wrong = server.url.replace(SECRET, SECRET + "-wrong")
        tier = RemoteTier(wrong, FP, BLOCK, 64 * (blk.HEADER_LEN + BLOCK), timeout_ms=2000, refresh_s=0.05)
        try:
            assert tier.write_many(_blocks(1)) == [False]
            assert not tier.healthy and "redis unreachable" in tier.reason
            shown = " ".join([tier.reason, tier.url, repr(tier.stats())])
        finally:
            tier.close()
    assert SECRET not in shown and SECRET not in caplog.text


def test_url_errors_never_show_the_password():
    from tierguard.serve.tier_flags import check_redis_url

    for url, words in ((f"redis://:{SECRET}@h", "names no port"), (f"redis://tg:{SECRET}@h:1/x", "database"),
                       (f"http://:{SECRET}@h:1", "must be redis://")):
        with pytest.raises(TierguardError) as err:
            check_redis_url(url, "--kv-remote-url")
        assert words in str(err.value) and SECRET not in str(err.value) and "***" in str(err.value)
    check_redis_url(f"rediss://tg:{SECRET}@h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required", "--kv-remote-url")


def test_serve_with_a_remote_tier_behind_auth_and_tls(redis_server, caplog):
    """Serve's engine and app with --kv-remote-url on an ACL user over TLS with a client
    certificate: /health says the tier is healthy, an answer is written behind to Redis."""
    from tests.serve.helpers import serve
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model
    from tierguard.serve.app import create_app

    caplog.set_level(logging.DEBUG)
    with RedisServer(user=("tg", SECRET), tls_client_auth=True) as server:
        engine = AsyncLLMEngine.from_model_dir(
            ensure_tiny_model(), model_name="tiny", max_model_len=256, kv_cache_gib=0.02, dtype="float32",
            device="cpu", kv_host_gib=0.01,
            kv_media={"remote": {"url": server.url, "refresh_s": 0.02, "timeout_ms": 2000}},
        )  # fmt: skip
        body = {"prompt": list(range(10, 74)), "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

        async def go() -> tuple[dict, str]:
            async with serve(create_app(engine)) as client:
                r = await client.post("/v1/completions", json=body)
                assert r.status == 200
                for _ in range(500):  # the write-behind lands after the answer
                    text = await (await client.get("/metrics")).text()
                    if "tierguard:engine_kv_remote_writes_total 0.0" not in text:
                        break
                    await asyncio.sleep(0.02)
                return await (await client.get("/health")).json(), text

        health, metrics = asyncio.run(go())
        import redis

        stored = redis.Redis.from_url(server.url).dbsize()
    assert health["kv_tiers"]["remote_healthy"] is True, health
    assert stored > 0
    for text in (str(health), metrics, caplog.text):
        assert SECRET not in text
