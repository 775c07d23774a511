"""A gate in front of two real `tierguard serve` replicas (tiny engines, in process) routes
around one whose engine has stopped.

The engine is stopped on purpose: the test makes its step raise, a failure no single
request owns. Its server then answers /health with 503 and marks its error answers
`X-Tierguard-Engine-State: dead`. Either is enough for the gate: the mark ejects the
replica on the request that met it, the probe within its interval.
"""

from __future__ import annotations

import asyncio

from tests.serve.helpers import gate, serve, url_of
from tierguard.serve.app import create_app

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 3, "ignore_eos": True}


def _engines():
    from tierguard.engine.async_engine import AsyncLLMEngine
    from tierguard.model.tiny import ensure_tiny_model

    return [AsyncLLMEngine.from_model_dir(ensure_tiny_model(), model_name="tiny", max_model_len=128,
                                          kv_cache_gib=0.01, dtype="float32", device="cpu") for _ in range(2)]


def _break(engine) -> None:
    def step():
        raise RuntimeError("injected: device lost")

    engine.engine.step = step


async def _post(client, path: str = "/v1/completions"):
    async with client.post(path, json=BODY) as r:
        return r.status, await r.json(), r.headers.get("X-Tierguard-Replica")


async def _upstreams(front) -> list[dict]:
    async with front.get("/health") as r:
        return (await r.json())["upstreams"]


def test_a_request_that_meets_a_dead_engine_ejects_its_replica_at_once(tmp_path):
    """Round robin sends the first request to replica 0, whose engine stops under it: that
    request gets an error answer (500: it may have caused the failure, so it is not tried
    again elsewhere), replica 0 is ejected at once (no probe is due for 30 s), and every
    later request is served by replica 1."""
    engines = _engines()
    _break(engines[0])

    async def go():
        async with serve(create_app(engines[0])) as r0, serve(create_app(engines[1])) as r1, \
                gate([url_of(r0), url_of(r1)], str(tmp_path), route="round-robin", route_headers=True,
                     health_interval_s=30) as front:
            first = await asyncio.wait_for(_post(front), 60)
            view = await _upstreams(front)
            later = [await _post(front) for _ in range(4)]
            direct = await _post(r0)
            return first, view, later, direct

    first, view, later, direct = asyncio.run(go())
    assert first[0] == 500 and "stopped while serving" in first[1]["error"]["message"], first
    assert first[2] == "0"
    assert view[0]["healthy"] is False and view[0]["ejections"] == 1, view[0]
    assert view[0]["status"] == 503 and view[0]["health"]["status"] == "dead", view[0]
    assert view[1]["healthy"] is True
    assert [(s, replica) for s, _, replica in later] == [(200, "1")] * 4, later
    assert direct[0] == 503  # the dead replica refuses at once: nothing can start there


def test_the_health_probe_ejects_a_replica_whose_engine_stopped(tmp_path):
    """The engine stops on a request sent to the replica directly, so the gate learns it
    from its /health probe alone (503 "dead") and routes around it."""
    engines = _engines()
    _break(engines[0])

    async def go():
        async with serve(create_app(engines[0])) as r0, serve(create_app(engines[1])) as r1, \
                gate([url_of(r0), url_of(r1)], str(tmp_path), route="round-robin", route_headers=True,
                     health_interval_s=0.2) as front:
            assert (await _upstreams(front))[0]["healthy"] is True
            killed = await asyncio.wait_for(_post(r0), 60)
            views: list = []

            async def ejected() -> bool:
                views.append(await _upstreams(front))
                return views[-1][0]["healthy"] is False

            # a hang guard, not a speed target: probes every 0.2 s eject it within a second or two
            deadline = asyncio.get_running_loop().time() + 15
            while not await ejected() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            later = [await _post(front) for _ in range(4)]
            return killed, views[-1], later

    killed, view, later = asyncio.run(go())
    assert killed[0] == 500, killed
    assert view[0]["healthy"] is False and "503" in (view[0]["last_error"] or ""), view[0]
    assert [(s, replica) for s, _, replica in later] == [(200, "1")] * 4, later


def test_an_async_job_meeting_a_dead_engine_ejects_it_and_runs_elsewhere_as_batch(tmp_path):
    """A job (202, the batch class) routed to a replica whose engine stopped meets the
    engine-dead mark: the replica is ejected at once and the job runs on the other one,
    which sees it as batch."""
    from tests.serve.fake_engine import FakeEngine

    engines = _engines()
    _break(engines[0])
    fake = FakeEngine()

    async def go():
        async with serve(create_app(engines[0])) as r0, serve(create_app(fake)) as r1, \
                gate([url_of(r0), url_of(r1)], str(tmp_path), route="round-robin", route_headers=True,
                     health_interval_s=30) as front:
            killed = await asyncio.wait_for(_post(r0), 60)  # the engine stops; the gate has not probed yet
            job_body = {k: v for k, v in BODY.items() if k != "model"}  # the other replica serves another name
            async with front.post("/v1/completions", json={**job_body, "tierguard_async": True}) as r:
                assert r.status == 202, await r.text()
                url = (await r.json())["url"]
            deadline = asyncio.get_running_loop().time() + 60  # a hang guard, not a speed target
            while True:
                async with front.get(url) as r:
                    job = await r.json()
                if job["status"] not in ("queued", "running") or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.05)
            return killed, job, await _upstreams(front)

    killed, job, view = asyncio.run(go())
    assert killed[0] == 500
    assert job["status"] == "succeeded", {k: job.get(k) for k in ("status", "error", "http_status", "attempts")}
    assert view[0]["healthy"] is False and view[0]["last_error"] == "engine_dead", view[0]
    assert fake.seen_classes == ["batch"]
