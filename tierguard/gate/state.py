"""Everything one running gate owns, built at startup and torn down at cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from tierguard.common.crypto import KeyRing
from tierguard.common.peers import PeerGuard, PeerLimits
from tierguard.common.redact import redact_url
from tierguard.gate.admission import AdmissionController
from tierguard.gate.forward import Upstream
from tierguard.gate.jobs import JobStore
from tierguard.gate.leases import LeaseStore
from tierguard.gate.metrics import GateMetrics
from tierguard.gate.policy import GateSettings
from tierguard.gate.reqlog import RequestLog
from tierguard.gate.routing import RoundRobin, make_router
from tierguard.gate.runner import JobRunner
from tierguard.gate.shared_admission import SharedAdmission
from tierguard.gate.tokens import LocalTokenizer, TokenCounter, UpstreamTokenizer
from tierguard.gate.tokens_fit import TokenBytes
from tierguard.gate.ttft_admission import PredictedAdmission
from tierguard.gate.upstreams import Fleet

log = logging.getLogger("tierguard.gate")
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # when neither max_model_len nor a local tokenizer is known


def peer_limits(s: GateSettings) -> PeerLimits:
    return PeerLimits(header_timeout_s=s.header_timeout_s, body_timeout_s=s.body_timeout_s,
                      slow_reader_bytes=s.slow_reader_bytes).validate()


@dataclass
class GateState:
    settings: GateSettings
    controller: AdmissionController | SharedAdmission | PredictedAdmission
    metrics: GateMetrics
    reqlog: RequestLog
    jobs: JobStore
    session: aiohttp.ClientSession
    upstream: Upstream  # the first replica: /tokenize when counting remotely
    fleet: Fleet  # every replica, health and routing
    counter: TokenCounter
    runner: JobRunner
    guard: PeerGuard
    max_body_bytes: int
    max_model_len: int | None = None  # the upstream's context limit, when known
    token_bytes: TokenBytes | None = None  # the byte rule (local tokenizer + max_model_len only)
    upstream_failures: int = 0  # consecutive failed upstream calls (for /health)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    async def create(cls, settings: GateSettings, guard: PeerGuard | None = None) -> GateState:
        s = settings
        guard = guard or PeerGuard(peer_limits(s))
        controller: AdmissionController | SharedAdmission | PredictedAdmission
        if s.admission == "predicted":
            controller = await _predicted(s)
        elif s.shared_state:
            store = LeaseStore(s.shared_state, prefix=s.shared_prefix, lease_ms=s.lease_ms,
                               timeout_s=s.shared_timeout_ms / 1000)
            controller = SharedAdmission(s.policy, store, min_gates=s.shared_gates)
            await controller.start()
            log.info("shared limits in %s (prefix %s, lease %d ms): %s", redact_url(s.shared_state), s.shared_prefix,
                     s.lease_ms, f"{controller.counters.live_gates} live gate(s)" if controller.up
                     else "unreachable, local share for now")
        else:
            controller = AdmissionController(s.policy)
        timeout = aiohttp.ClientTimeout(total=s.total_timeout_s, connect=s.connect_timeout_s,
                                        sock_read=s.read_timeout_s)
        connector = aiohttp.TCPConnector(limit=s.upstream_pool, limit_per_host=s.upstream_pool,
                                         keepalive_timeout=30)
        # No cookie jar: a proxy must not carry one client's upstream cookies to the next
        # (and skipping the jar is one less lookup per request).
        session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                        cookie_jar=aiohttp.DummyCookieJar())
        headers = {"Content-Type": "application/json"}
        if s.upstream_api_key:
            headers["Authorization"] = f"Bearer {s.upstream_api_key}"
        upstreams = [Upstream(session, url, headers, s.first_byte_timeout_s) for url in s.upstreams]
        upstream = upstreams[0]
        router = make_router(s.route, len(upstreams), beta=s.route_beta, imbalance=s.route_imbalance,
                             index_entries=s.route_index_entries) if len(upstreams) > 1 else RoundRobin()
        fleet = Fleet(upstreams, router, health_interval_s=s.health_interval_s, eject_after=s.eject_after)
        if len(upstreams) > 1:
            log.info("%d upstreams, route %s: %s", len(upstreams), s.route, ", ".join(map(redact_url, s.upstreams)))
        counter: TokenCounter
        if s.tokenizer:
            counter = LocalTokenizer(s.tokenizer, use_byte_bound=not s.exact_token_count,
                                     workers=s.tokenizer_workers, max_pending=s.tokenizer_queue)
            await counter.pool.warm()
        else:
            remote = UpstreamTokenizer(session, s.upstream, headers, use_byte_bound=not s.exact_token_count,
                                       pick=(lambda: fleet.any_replica().url) if len(upstreams) > 1 else None)
            counter = remote if await remote.probe() else TokenCounter()
        log.info("token counting: %s", counter.source)
        max_model_len = s.max_model_len or await _upstream_max_model_len(session, s.upstream, headers)
        rule = counter.token_bytes if isinstance(counter, LocalTokenizer) else None
        derived = rule.body_limit(max_model_len) if rule and max_model_len else None
        max_body = s.max_body_bytes or derived or DEFAULT_MAX_BODY_BYTES
        if derived and max_body > derived:
            log.warning("--max-body-bytes %d is above %d, the most a prompt that fits max_model_len %d can need: "
                        "bigger bodies are read and parsed only to be refused", max_body, derived, max_model_len)
        log.info("max_model_len %s; body limit %d bytes; byte rule: %s", max_model_len or "unknown", max_body,
                 f"on (a token covers at most {rule.max_bytes} bytes)" if rule and rule.exact and max_model_len
                 else "off (needs --tokenizer of a byte-level tokenizer and a known max_model_len)")
        reqlog = RequestLog(s.log, s.log_prompts)
        keyring = KeyRing.from_files(s.encrypt_key_file, [s.encrypt_old_key_file] if s.encrypt_old_key_file
                                     else []) if s.encrypt_key_file else None
        jobs = await asyncio.to_thread(JobStore, s.jobs_dir, ttl_s=s.job_ttl_s, keyring=keyring,
                                       limits=s.job_limits())
        swept = await asyncio.to_thread(jobs.sweep)
        if not s.api_keys:
            log.warning("no API keys configured (--api-key, --api-key-file): anyone who can reach the gate may "
                        "use it, and an async job's result is visible to anyone who knows its id")
        if keyring is None:
            log.warning("async job files (prompts and answers) are stored unencrypted in %s; "
                        "pass --encrypt-key-file to encrypt them", s.jobs_dir)
        runner = JobRunner(jobs, controller, fleet, reqlog, s.async_workers)
        requeued = await runner.start()
        log.info("async jobs in %s (%s, deleted %g s after they finish): %d re-queued, %d old results removed",
                 s.jobs_dir, f"AES-256-GCM, key {keyring.current.id_hex}" if keyring else "unencrypted",
                 s.job_ttl_s, requeued, swept)
        state = cls(settings=s, controller=controller, metrics=GateMetrics(controller), reqlog=reqlog, jobs=jobs,
                    session=session, upstream=upstream, fleet=fleet, counter=counter, runner=runner, guard=guard,
                    max_body_bytes=max_body, max_model_len=max_model_len,
                    token_bytes=rule if rule is not None and rule.exact and max_model_len else None)
        state.metrics.add_edge(guard, counter.pool if isinstance(counter, LocalTokenizer) else None, jobs, runner)
        state.metrics.add_fleet(fleet, controller if isinstance(controller, SharedAdmission) else None)
        if isinstance(controller, PredictedAdmission):
            controller.attach(lambda i: fleet.replicas[i].healthy)
            state.metrics.add_prediction(controller)
        fleet.start()
        state.tasks.append(asyncio.create_task(state._sweep_jobs()))
        return state

    async def _sweep_jobs(self) -> None:
        """Who deletes results, and when: every min(ttl/4, 60) s, those finished ttl ago."""
        period = min(self.settings.job_ttl_s / 4, 60.0)
        while True:
            await asyncio.sleep(period)
            try:
                n = await asyncio.to_thread(self.jobs.sweep)
            except Exception:  # a sweep failing once must not stop later sweeps
                log.exception("sweeping async jobs failed")
                continue
            if n:
                log.info("async jobs: %d expired results deleted", n)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.runner.stop()
        await self.fleet.stop()
        if isinstance(self.controller, (SharedAdmission, PredictedAdmission)):
            await self.controller.close()
        await self.session.close()
        if isinstance(self.counter, LocalTokenizer):
            self.counter.pool.close()
        self.reqlog.close()


async def _predicted(s: GateSettings) -> PredictedAdmission:
    """Predicted-TTFT admission; under --shared-state the queued work is shared, not the slots."""
    from tierguard.gate.ttft_options import options_from
    from tierguard.gate.ttft_shared import SharedWork

    shared = SharedWork(s.shared_state, prefix=s.shared_prefix, lease_ms=s.lease_ms,
                        timeout_s=s.shared_timeout_ms / 1000) if s.shared_state else None
    options = options_from(s)
    controller = PredictedAdmission(s.policy, options, s.upstreams, shared=shared)
    await controller.start()
    for u in controller.upstreams:
        log.info("predicted admission for %s: costs from %s, SLO %s, online fit %s", u.url, u.fit.prior.source,
                 ", ".join(f"{k} {v * 1000:g} ms" for k, v in options.slo_s.items()),
                 "on" if options.online else "off")
    return controller


GATE = web.AppKey("tierguard_gate", GateState)  # the running gate's state, on its aiohttp app


async def _upstream_max_model_len(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> int | None:
    """The largest `max_model_len` in the upstream's /v1/models (vLLM and tierguard report it)."""
    try:
        async with asyncio.timeout(5.0):
            async with session.get(base + "/v1/models", headers=headers) as r:
                data = await r.json(content_type=None) if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    lens = [m.get("max_model_len") for m in (data.get("data") or []) if isinstance(m, dict)] \
        if isinstance(data, dict) else []
    lens = [n for n in lens if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return max(lens) if lens else None
