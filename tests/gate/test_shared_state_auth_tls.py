"""`--shared-state` against a real redis-server that wants a password, or an ACL user over
TLS with a client certificate: the gate's limits become shared, and its log (start-up, and
the warnings once Redis dies) names the Redis without the password."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.gate.helpers import GateProcess, get_json, run
from tierguard.bench.schedule_server import ScheduleServer
from tierguard.common.redis_server import RedisServer

SECRET = "s3cret-Pa55word"


@pytest.mark.parametrize("kw", [{"password": SECRET}, {"user": ("tg", SECRET), "tls_client_auth": True}],
                         ids=["requirepass", "tls_acl_client_cert"])
def test_shared_state_with_auth_and_tls_and_no_password_in_the_log(tmp_path, redis_server, kw):
    with RedisServer(**kw) as server, ScheduleServer(ttft_ms=5, itl_ms=1, output_tokens=2) as up, \
            GateProcess(up.base_url, "-v", "--shared-state", server.url, "--shared-timeout-ms", "1000",
                        "--lease-ms", "5000", jobs_dir=tmp_path / "jobs") as gate:

        async def go() -> tuple[int, dict]:
            async with aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 30
                while not (await get_json(s, gate.url + "/health"))[1]["shared_state"]["up"]:
                    assert time.monotonic() < deadline, "shared state never came up"
                    await asyncio.sleep(0.05)
                async with s.post(gate.url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                    status = r.status
                server.kill()  # the warnings that follow name the Redis too
                while (health := (await get_json(s, gate.url + "/health"))[1])["shared_state"]["up"]:
                    assert time.monotonic() < deadline + 30, "Redis down never noticed"
                    await asyncio.sleep(0.05)
                return status, health

        status, health = run(go())
        assert status == 200 and health["status"] == "degraded"
        gate.stop()
        log = gate.stderr()
    assert "shared limits in " in log and "***@127.0.0.1" in log, log
    assert "unreachable" in log
    assert SECRET not in log
