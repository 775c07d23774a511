"""The gate's aiohttp application and its server loop.

Routes: POST /v1/completions, /v1/chat/completions (and /v1/async/... for jobs),
POST /tokenize, /detokenize (passed to a replica: clients count tokens exactly through the
gate), GET /v1/async/{id}, /v1/models, /health, /metrics. The application is built without
starting a server so tests can mount it on an ephemeral port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import aiohttp
from aiohttp import web

from tierguard.common.peer_conn import guarded_runner
from tierguard.common.peers import BodyError, PeerGuard, expect_json
from tierguard.common.redact import redact_url
from tierguard.gate.forward import UpstreamError
from tierguard.gate.http import auth_middleware, error_response, json_errors_middleware, read_json, tenant
from tierguard.gate.policy import GateSettings
from tierguard.gate.proxy import completions
from tierguard.gate.reqlog import RequestRecord
from tierguard.gate.shared_admission import SharedAdmission
from tierguard.gate.state import GATE, GateState, peer_limits

log = logging.getLogger("tierguard.gate")
GUARD = web.AppKey("tierguard_gate_guard", PeerGuard)  # slow peers and edge counters of this gate


async def job_status(request: web.Request) -> web.Response:
    """A job, to the key that created it only: any other key gets the same 404 as an unknown id
    (telling "exists, not yours" apart would confirm that a guessed id exists)."""
    state = request.app[GATE]
    job = await asyncio.to_thread(state.jobs.load, request.match_info["job_id"])  # file read + decrypt
    if job is None or job.owner != tenant(request, state.settings.api_keys):
        return error_response(404, "no such async job")
    return web.json_response(job.public())


async def models(request: web.Request) -> web.Response:
    state = request.app[GATE]
    u = state.fleet.any_replica().upstream
    try:
        async with asyncio.timeout(state.settings.first_byte_timeout_s):
            async with state.session.get(u.base_url + "/v1/models", headers=u.headers) as resp:
                return web.Response(body=await resp.read(), status=resp.status,
                                    content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as exc:
        err = UpstreamError(502, "unreachable", f"upstream /v1/models failed: {type(exc).__name__}")
        return error_response(err.status, err.message, etype="upstream_error")


async def token_route(request: web.Request) -> web.Response:
    """/tokenize and /detokenize, answered by the least loaded healthy replica (one model for
    the fleet, so any replica counts the same). Admission does not apply: no generation."""
    state = request.app[GATE]
    try:
        body = await read_json(request, state.guard, state.max_body_bytes)
    except BodyError as exc:  # 400 / 408 / 413
        resp = error_response(exc.status, exc.message)
        if exc.status != 400:
            resp.force_close()  # the rest of the body was not read: the connection cannot be reused
        return resp
    u = state.fleet.any_replica().upstream
    try:
        async with asyncio.timeout(state.settings.first_byte_timeout_s):
            async with state.session.post(u.base_url + request.path, json=body, headers=u.headers) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(502, f"upstream {request.path} failed: {type(exc).__name__}", etype="upstream_error")


async def _probe(state: GateState, u) -> dict:
    out: dict = {"url": redact_url(u.base_url)}
    try:
        async with asyncio.timeout(2.0):
            async with state.session.get(u.base_url + "/health", headers=u.headers) as r:
                out.update(ok=r.status == 200, status=r.status)
                if r.content_type == "application/json":
                    out["health"] = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.update(ok=False, error=type(exc).__name__)
    return out


async def health(request: web.Request) -> web.Response:
    """Gate state plus one short probe of each upstream: "ok" when all answer, "degraded" when
    some do (and under --shared-state while Redis is unreachable), 503 "upstream_down" when none do."""
    state = request.app[GATE]
    probes = await asyncio.gather(*(_probe(state, r.upstream) for r in state.fleet.replicas))
    alive = sum(p["ok"] for p in probes)
    stats = state.controller.stats()
    status = "ok" if alive == len(probes) else "degraded" if alive else "upstream_down"
    body: dict = {"status": status, "token_counter": state.counter.source,
                  "token_counts": {"exact": state.counter.exact_counts, "byte_bound": state.counter.bound_skips},
                  "queued": stats.queued, "in_flight": stats.in_flight,
                  "consecutive_upstream_failures": state.upstream_failures}
    if len(probes) == 1:
        body["upstream"] = probes[0]
    for probe, view in zip(probes, state.fleet.stats(), strict=True):
        probe.update({k: v for k, v in view.items() if k != "url"})
    body["upstreams"] = probes
    if isinstance(state.controller, SharedAdmission):
        shared = state.controller
        body["shared_state"] = {"up": shared.up, "live_gates": shared.counters.live_gates,
                                "local_share": {"max_concurrency": shared.local.policy.max_concurrency,
                                                "max_long": shared.local.policy.max_long}}
        if not shared.up and status == "ok":
            body["status"] = "degraded"
    return web.json_response(body, status=200 if alive else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})


def _refused(request: web.Request) -> None:
    """A request without a valid key is a request too: one log line (no key in it), counted."""
    state = request.app[GATE]
    state.reqlog.write(RequestRecord(route=request.path, decision="reject", reason="unauthenticated", status=401))
    state.metrics.child(state.metrics.responses, "401").inc()


def build_app(settings: GateSettings) -> web.Application:
    """The gate; serve it with `guarded_runner(app[GUARD], app)` so the header deadline applies."""
    guard = PeerGuard(peer_limits(settings))
    # The size limit is enforced by read_json with a clear message; this is a backstop.
    # The guard's middleware goes first: it must see refused requests too (to stop their header timer).
    middlewares = [guard.middleware(), json_errors_middleware(), auth_middleware(settings.api_keys, _refused)]
    app = web.Application(middlewares=middlewares,
                          client_max_size=(settings.max_body_bytes or 64 * 1024**2) + 1024)
    app[GUARD] = guard

    async def startup(app: web.Application) -> None:
        app[GATE] = await GateState.create(settings, guard)

    async def cleanup(app: web.Application) -> None:
        await app[GATE].close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    # expect_json: an unknown `Expect:` gets a JSON 417 too (aiohttp answers it before any middleware)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/async/completions", "/v1/async/chat/completions"):
        app.router.add_post(path, completions, expect_handler=expect_json)
    for path in ("/tokenize", "/detokenize"):
        app.router.add_post(path, token_route, expect_handler=expect_json)
    for path, handler in (("/v1/async/{job_id}", job_status), ("/v1/models", models), ("/health", health),
                          ("/metrics", metrics)):
        app.router.add_get(path, handler, expect_handler=expect_json)
    return app


async def serve(settings: GateSettings, on_ready: Callable[[int], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). Handlers are cancelled when a client
    disconnects, which is what frees its slot and closes its upstream request."""
    app = build_app(settings)
    runner = guarded_runner(app[GUARD], app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.info("tierguard gate listening on http://%s:%d -> %s", settings.host, port,
             ", ".join(map(redact_url, settings.upstreams)))
    if on_ready is not None:
        on_ready(port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
