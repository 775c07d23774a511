"""The remote tier behind `tierguard serve`: its flags, /health and /metrics while Redis
is up, then killed with SIGKILL mid-run (degraded, still 200 and serving)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tierguard.cli.main import main
from tierguard.common.errors import TierguardError
from tierguard.serve.app import create_app
from tierguard.serve.tier_flags import add_tier_flags, tier_kwargs

from .helpers import serve


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tier_flags(p)
    return p.parse_args(list(argv))


def test_remote_flags_become_one_medium_entry():
    kw = tier_kwargs(
        parse("--kv-host-gib", "0.5", "--kv-remote-url", "redis://10.0.0.7:6380/2", "--kv-remote-ttl-s", "90",
              "--kv-remote-gib", "2", "--kv-remote-timeout-ms", "20")
    )  # fmt: skip
    assert kw["kv_media"] == {
        "remote": {
            "url": "redis://10.0.0.7:6380/2",
            "ttl_s": 90.0,
            "capacity_bytes": 2 << 30,
            "timeout_ms": 20.0,
        }
    }
    assert "kv_media" not in tier_kwargs(parse("--kv-host-gib", "0.5"))
    for bad, msg in [
        (("--kv-remote-url", "redis://h:1"), "needs --kv-host-gib"),
        (("--kv-host-gib", "1", "--kv-remote-url", "http://h:1"), "must be redis://HOST:PORT"),
        (("--kv-host-gib", "1", "--kv-remote-url", "redis://h"), "names no port"),
        (("--kv-host-gib", "1", "--kv-remote-url", "redis://h:99999"), "out of range"),
        (("--kv-host-gib", "1", "--kv-remote-url", "redis://h:1/x"), "database must be a number"),
        (
            ("--kv-host-gib", "1", "--kv-remote-url", "redis://h:1", "--kv-remote-ttl-s", "0"),
            "ttl-s must be positive",
        ),
        (
            ("--kv-host-gib", "1", "--kv-remote-url", "redis://h:1", "--kv-remote-gib", "-1"),
            "gib must be positive",
        ),
    ]:
        with pytest.raises(TierguardError, match=msg):
            tier_kwargs(parse(*bad))


def test_a_bad_remote_url_is_one_line_and_exit_2(capsys):
    assert main(["serve", "--kv-host-gib", "0.1", "--kv-remote-url", "memcached://h:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--kv-remote-url must be redis://HOST:PORT[/DB]" in err


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_health_and_metrics_while_redis_is_up_then_killed(redis_server):
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    engine = AsyncLLMEngine.from_model_dir(
        ensure_tiny_model(), model_name="tiny", max_model_len=256, kv_cache_gib=0.02, dtype="float32",
        device="cpu", kv_host_gib=0.01,
        kv_media={"remote": {"url": redis_server.url, "refresh_s": 0.02, "timeout_ms": 50}},
    )  # fmt: skip
    prompt = list(range(10, 74))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def go() -> None:
        async with serve(create_app(engine)) as client:
            health = await (await client.get("/health")).json()
            assert health["status"] == "ok" and health["kv_tiers"]["remote_healthy"] is True
            r = await client.post("/v1/completions", json=body)
            assert r.status == 200

            async def metrics() -> str:
                return await (await client.get("/metrics")).text()

            for _ in range(200):  # the write-behind lands after the answer
                if _sample(await metrics(), "tierguard:engine_kv_remote_writes_total") > 0:
                    break
                await asyncio.sleep(0.02)
            text = await metrics()
            assert _sample(text, "tierguard:engine_kv_remote_write_bytes_total") > 0
            assert _sample(text, "tierguard:engine_kv_remote_blocks") == len(prompt) // 16
            assert (
                'tierguard:kv_transfer_latency_seconds_count{model_name="tiny",route="host_to_remote"}'
                in text
            )
            for name in ("hits", "misses", "errors", "read_bytes"):
                _sample(text, f"tierguard:engine_kv_remote_{name}_total")  # exported from the start

            redis_server.kill()  # SIGKILL, mid-run
            state = {}

            async def degraded() -> bool:
                state.update(await (await client.get("/health")).json())
                return state["status"] == "degraded"

            for _ in range(200):
                if await degraded():
                    break
                await asyncio.sleep(0.02)
            assert state["status"] == "degraded" and state["kv_tiers"]["remote_healthy"] is False
            assert "redis unreachable" in state["kv_tiers"]["remote_reason"]
            for _ in range(100):  # an idle engine's /metrics follows too (its snapshot is refreshed)
                if _sample(await metrics(), "tierguard:engine_kv_remote_healthy") == 0:
                    break
                await asyncio.sleep(0.02)
            assert _sample(await metrics(), "tierguard:engine_kv_remote_healthy") == 0
            r = await client.post("/v1/completions", json={**body, "prompt": prompt[::-1]})
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
            assert _sample(await metrics(), "tierguard:engine_kv_remote_errors_total") > 0

    asyncio.run(go())


def test_two_replicas_share_a_prefix_through_redis(redis_server):
    """The small version of tests/serve/test_remote_tier_replicas.py (two server processes,
    slow): two `serve` apps, each on its own engine, on one real Redis. A prefix answered
    by A is written behind to Redis; B, which never saw it, stages it from Redis and says
    so: remote hits in its /metrics, cached tokens in its usage, the same greedy answer."""
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    def replica() -> AsyncLLMEngine:
        return AsyncLLMEngine.from_model_dir(
            ensure_tiny_model(), model_name="tiny", max_model_len=256, kv_cache_gib=0.02, dtype="float32",
            device="cpu", kv_host_gib=0.01,
            kv_media={"remote": {"url": redis_server.url, "refresh_s": 0.02, "timeout_ms": 200}},
        )  # fmt: skip

    a, b = replica(), replica()
    prompt = list(range(20, 84))  # 4 full blocks of 16
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def go() -> None:
        async with serve(create_app(a, prompt_tokens_details=True)) as ca, \
                serve(create_app(b, prompt_tokens_details=True)) as cb:

            async def metric(client, name: str) -> float:
                return _sample(await (await client.get("/metrics")).text(), name)

            ra = await ca.post("/v1/completions", json=body)
            first = await ra.json()
            assert ra.status == 200 and "prompt_tokens_details" not in first["usage"]  # A computed it all
            for _ in range(500):  # A's write-behind, then B's journal refresh
                if await metric(ca, "tierguard:engine_kv_remote_writes_total") >= 4 and \
                        await metric(cb, "tierguard:engine_kv_remote_blocks") >= 4:
                    break
                await asyncio.sleep(0.02)
            assert await metric(cb, "tierguard:engine_kv_remote_blocks") >= 4  # B learned A's blocks
            rb = await cb.post("/v1/completions", json=body)
            second = await rb.json()
            assert rb.status == 200
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48  # staged, not recomputed
            assert await metric(cb, "tierguard:engine_kv_remote_hits_total") >= 3
            assert await metric(ca, "tierguard:engine_kv_remote_hits_total") == 0

    asyncio.run(go())
