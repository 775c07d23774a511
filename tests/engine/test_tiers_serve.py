"""The tiers behind `tierguard serve`: flags, /health with a broken disk tier, and a real
server restarted on the same disk directory serving a saved prefix from the disk tier."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.engine.conftest import prompt_ids
from tierguard.cli.serve import READY_PREFIX
from tierguard.common.errors import TierguardError
from tierguard.common.proc import ReadyProcess
from tierguard.serve.tier_flags import add_tier_flags, tier_kwargs


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tier_flags(p)
    return p.parse_args(list(argv))


def test_tier_flags(tmp_path):
    kw = tier_kwargs(
        parse(
            "--kv-host-gib", "0.5", "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "2",
            "--ttft-budget-ms", "interactive=800,batch=20000",
        )
    )  # fmt: skip
    assert kw["kv_host_gib"] == 0.5 and kw["kv_disk_gib"] == 2.0
    assert kw["ttft_budget_ms"] == {"interactive": 800.0, "batch": 20000.0}
    assert tier_kwargs(parse())["kv_host_gib"] == 0.0
    for bad, msg in [
        (("--kv-disk-gib", "1"), "kv-disk-dir"),
        (("--kv-disk-dir", str(tmp_path)), "kv-disk-gib"),
        (("--kv-host-gib", "-1"), "kv-host-gib"),
        (("--kv-naive-sync-disk",), "disk tier"),
        (("--ttft-budget-ms", "slow=5"), "request class"),
    ]:
        with pytest.raises(TierguardError, match=msg):
            tier_kwargs(parse(*bad))


def test_health_degraded_but_serving_with_a_broken_disk_tier(tiny_dir, tmp_path):
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.serve.app import create_app

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    engine = AsyncLLMEngine.from_model_dir(
        tiny_dir,
        dtype="float32",
        device="cpu",
        kv_cache_gib=0.01,
        block_size=4,
        max_model_len=256,
        kv_host_gib=0.01,
        kv_disk_dir=str(not_a_dir),
        kv_disk_gib=0.01,
    )

    async def go() -> None:
        client = TestClient(TestServer(create_app(engine), host="127.0.0.1", port=0))
        await client.start_server()
        try:
            r = await client.get("/health")
            body = await r.json()
            assert r.status == 200 and body["status"] == "degraded"
            assert body["kv_tiers"]["disk_healthy"] is False and body["kv_tiers"]["disk_reason"]
            r = await client.post("/v1/completions", json={"prompt": prompt_ids(1, 20), "max_tokens": 4})
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4
            metrics = await (await client.get("/metrics")).text()
            assert "tierguard:engine_kv_disk_healthy" in metrics
        finally:
            await client.close()

    asyncio.run(go())


def _start(disk, log) -> ReadyProcess:
    cmd = [
        sys.executable, "-m", "tierguard", "serve", "--model", "tiny", "--port", "0",
        "--max-model-len", "1024", "--kv-cache-gib", "0.02",
        "--kv-host-gib", "0.02", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.1",
    ]  # fmt: skip
    return ReadyProcess(cmd, READY_PREFIX, stderr_path=log)


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _complete(url: str, prompt: list[int], wait_persisted: bool = True) -> tuple[list, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            text = (await r.json())["choices"][0]["text"]
        for _ in range(200 if wait_persisted else 1):  # write-behind: wait for the blocks to reach the disk
            metrics = await (await s.get(url + "/metrics")).text()
            if _gauge(metrics, "tierguard:engine_kv_persisted_blocks_total") > 0:
                break
            await asyncio.sleep(0.05)
        return text, metrics


def test_prefix_survives_a_server_restart(tmp_path):
    disk, prompt = tmp_path / "kv", prompt_ids(3, 300, vocab=4000)
    with _start(disk, tmp_path / "first.log") as server:
        url = server.start(timeout_s=300).split()[0]
        first, metrics = asyncio.run(_complete(url, prompt))
        assert _gauge(metrics, "tierguard:engine_kv_persisted_blocks_total") > 0
        # R13: the tier's device latency as a real histogram per transfer route
        counts = {
            line.split('route="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("tierguard:kv_transfer_latency_seconds_count{")
        }
        assert counts.get("device_to_host", 0) > 0 and counts.get("host_to_disk", 0) > 0, counts
    with _start(disk, tmp_path / "second.log") as server:  # a new process, same disk directory
        url = server.start(timeout_s=300).split()[0]
        again, metrics = asyncio.run(_complete(url, prompt))
    assert again == first
    assert _gauge(metrics, "tierguard:engine_kv_disk_hits_total") > 0
    assert _gauge(metrics, "tierguard:engine_kv_disk_reads_in_decode_total") == 0


def test_request_class_from_header_priority_or_service_tier():
    from tierguard.serve.protocol import CompletionRequest

    def cls(body: bytes, headers: dict[str, str] | None = None) -> str:
        return CompletionRequest.model_validate_json(body).resolve_class(headers or {})

    assert cls(b'{"prompt": "x"}') == "interactive"
    assert cls(b'{"prompt": "x", "service_tier": "flex"}') == "batch"
    assert cls(b'{"prompt": "x", "priority": 5}') == "batch"
    assert cls(b'{"prompt": "x"}', {"X-Tierguard-Class": "batch"}) == "batch"
    # tierguard's own field (set by the gate) wins over everything else
    assert cls(b'{"prompt": "x", "request_class": "interactive", "service_tier": "flex"}') == "interactive"
