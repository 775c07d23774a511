"""Everything one running gate owns, built at startup and torn down at cleanup."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp

from tierguard.gate.admission import AdmissionController
from tierguard.gate.forward import Upstream
from tierguard.gate.jobs import JobStore
from tierguard.gate.metrics import GateMetrics
from tierguard.gate.policy import GateSettings
from tierguard.gate.reqlog import RequestLog
from tierguard.gate.runner import JobRunner
from tierguard.gate.tokens import LocalTokenizer, TokenCounter, UpstreamTokenizer

log = logging.getLogger("tierguard.gate")


@dataclass
class GateState:
    settings: GateSettings
    controller: AdmissionController
    metrics: GateMetrics
    reqlog: RequestLog
    jobs: JobStore
    session: aiohttp.ClientSession
    upstream: Upstream
    counter: TokenCounter
    runner: JobRunner
    upstream_failures: int = 0  # consecutive failed upstream calls (for /health)

    @classmethod
    async def create(cls, settings: GateSettings) -> GateState:
        s = settings
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
        upstream = Upstream(session, s.upstream, headers, s.first_byte_timeout_s)
        counter: TokenCounter
        if s.tokenizer:
            counter = LocalTokenizer(s.tokenizer, use_byte_bound=not s.exact_token_count)
        else:
            remote = UpstreamTokenizer(session, s.upstream, headers, use_byte_bound=not s.exact_token_count)
            counter = remote if await remote.probe() else TokenCounter()
        log.info("token counting: %s", counter.source)
        reqlog = RequestLog(s.log, s.log_prompts)
        jobs = JobStore(s.jobs_dir)
        swept = jobs.sweep()
        runner = JobRunner(jobs, controller, upstream, reqlog, s.async_workers)
        requeued = runner.start()
        log.info("async jobs in %s: %d re-queued, %d old results removed", s.jobs_dir, requeued, swept)
        return cls(settings=s, controller=controller, metrics=GateMetrics(controller), reqlog=reqlog, jobs=jobs,
                   session=session, upstream=upstream, counter=counter, runner=runner)

    async def close(self) -> None:
        await self.runner.stop()
        await self.session.close()
        self.reqlog.close()
