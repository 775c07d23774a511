"""The replicas behind one gate: health, ejection with backoff, load, and the choice.

Mechanism only; where a request goes is `routing.py`'s decision. Each replica has a
watcher task: every `health_interval_s` it probes `GET /health` (a reply below 500
counts as alive, so servers without that route still pass) and scrapes `/metrics`
for the replica's own queue depth. Requests report their outcome too:

- connection refused or reset: ejected at once (the process is gone);
- an answer marked `X-Tierguard-Engine-State: dead` (a `tierguard serve` whose engine
  stopped): ejected at once, as its /health now fails too;
- a timeout, or a 502/504 before the first byte: ejected after `eject_after`
  consecutive ones (a slow replica is not a dead one); a plain 503 is busy, not broken:
  tried elsewhere, no step towards ejection;
- a failed probe (no answer, or a 5xx: serve's /health is 503 once its engine stopped):
  ejected at once.

An ejected replica gets no traffic and is probed again after its backoff: 1 s after
the first ejection, doubling with each further one up to `backoff_max_s`; a probe
that passes readmits it, a request that succeeds resets the backoff. Ejection also
clears what the prefix index says it holds: a replica that comes back may have
restarted with an empty cache. When every replica is ejected, all of them are
candidates again (earliest return first), so a lone upstream behaves as it always
did: its requests are tried and its errors reported, never refused by the gate alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp

from tierguard.common.redact import redact_url
from tierguard.gate.forward import Upstream, UpstreamError
from tierguard.gate.prefix_index import render_chat, render_prompt
from tierguard.gate.routing import PrefixAware, ReplicaLoad, RouteDecision, Router, RouteRequest
from tierguard.kv.contract import BATCH, CLASS_HEADER

log = logging.getLogger("tierguard.gate")
SESSION_HEADER = "X-Tierguard-Session"
# Set to "dead" by `tierguard serve` on an answer from a server whose engine has stopped.
# Queue depth a replica reports: vLLM (and `tierguard serve`, which uses vLLM's names) waiting
# requests, the admission queue of a tierguard server/gate, SGLang's queue, the schedule server's.
_WAITING = re.compile(rb"^(?:vllm:num_requests_waiting|tierguard_gate_queue_depth|sglang:num_queue_reqs"
                      rb"|schedule_requests_waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)\s*$", re.M)
_MAX_METRICS_BYTES = 4 * 1024 * 1024  # a replica's /metrics larger than this is not parsed


@dataclass
class Replica:
    """One upstream as this gate sees it. Mutated only on the gate's event loop."""

    index: int
    upstream: Upstream
    in_flight: int = 0  # this gate's requests running there now
    queued: int = 0  # its queue depth, as last scraped
    healthy: bool = True
    ejected_until: float = 0.0  # time.monotonic() of the next probe while ejected
    backoff_s: float = 0.0  # the last ejection's pause; 0 after a success
    soft_failures: int = 0  # consecutive timeouts / 502 / 504
    ejections: int = 0
    last_error: str | None = None
    scrape: str = "pending"  # ok | no /metrics | failed: ...
    wake: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # ejected: stop the healthy pause

    @property
    def url(self) -> str:
        return self.upstream.base_url

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.index, self.in_flight, self.queued)

    def view(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "queued": self.queued,
                "ejections": self.ejections, "last_error": self.last_error, "scrape": self.scrape}


class Fleet:
    """Replicas + a router: `choose()` for each attempt, `succeeded()`/`failed()` after it."""

    def __init__(self, upstreams: list[Upstream], router: Router, *, health_interval_s: float = 1.0,
                 eject_after: int = 3, backoff_min_s: float = 1.0, backoff_max_s: float = 30.0) -> None:
        if not upstreams:
            raise ValueError("a fleet needs at least one upstream")
        self.replicas = [Replica(i, u) for i, u in enumerate(upstreams)]
        self.router = router
        self.health_interval_s = health_interval_s
        self.eject_after = eject_after
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.routed: dict[tuple[int, str], int] = {}  # (replica, reason) -> count
        self._tasks: list[asyncio.Task] = []

    # ---- the request path ------------------------------------------------------------
    def request_for(self, body: dict, chat: bool, session_header: str | None) -> RouteRequest:
        """What the router needs of a request: prefix keys (prefix routing only) and session."""
        keys: list[int] = []
        if isinstance(self.router, PrefixAware):
            text = render_chat(body.get("messages")) if chat else render_prompt(body.get("prompt"))
            salt = body.get("cache_salt")
            keys = self.router.index.keys(text, salt if isinstance(salt, str) else None)
        user = body.get("user")
        session = session_header or (user if isinstance(user, str) and user else None)
        return RouteRequest(keys=keys, session=session)

    def choose(self, request: RouteRequest, exclude: Iterable[int] = ()) -> tuple[Replica, RouteDecision] | None:
        """The replica for the next attempt, or None when every replica was excluded."""
        skip = set(exclude)
        pool = [r for r in self.replicas if r.index not in skip]
        if not pool:
            return None
        healthy = [r for r in pool if r.healthy]
        if not healthy:  # all ejected: try the one due back first rather than refuse
            healthy = [min(pool, key=lambda r: r.ejected_until)]
        decision = self.router.choose(request, [r.load() for r in healthy])
        if skip:
            decision = RouteDecision(decision.replica, "failover", decision.share)
        key = (decision.replica, decision.reason)
        self.routed[key] = self.routed.get(key, 0) + 1
        return self.replicas[decision.replica], decision

    def succeeded(self, replica: Replica) -> None:
        replica.soft_failures = 0
        replica.backoff_s = 0.0

    def failed(self, replica: Replica, kind: str) -> None:
        """An attempt failed; `kind` from UpstreamError, a status ("status_502"), or
        "engine_dead" (an answer marked with ENGINE_STATE_HEADER)."""
        replica.last_error = kind
        if kind in ("unreachable", "engine_dead"):
            self._eject(replica, kind)
            return
        replica.soft_failures += 1
        if replica.soft_failures >= self.eject_after:
            self._eject(replica, f"{replica.soft_failures} failures in a row ({kind})")

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        """A whole non-streaming exchange (async jobs, the batch class), routed, retried once on
        another replica when it failed before any answer or met a stopped engine."""
        request = self.request_for(body, path.endswith("/chat/completions"), None)
        tried: list[int] = []
        last: UpstreamError | None = None
        for _ in range(2):  # the first choice, then once more elsewhere
            picked = self.choose(request, tried)
            if picked is None:
                break
            replica, _ = picked
            tried.append(replica.index)
            replica.in_flight += 1
            try:
                result = await replica.upstream.post_json(path, body, {CLASS_HEADER: BATCH})
            except UpstreamError as exc:
                self.failed(replica, exc.kind)
                last = exc
                continue
            finally:
                replica.in_flight -= 1
            self.succeeded(replica)
            return result
        raise last or UpstreamError(502, "unreachable", "no upstream to try")

    def any_replica(self) -> Replica:
        """For calls that are not routed (/v1/models): the least loaded healthy replica."""
        healthy = [r for r in self.replicas if r.healthy] or self.replicas
        return min(healthy, key=lambda r: (r.in_flight + r.queued, r.index))

    # ---- health ----------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(r)) for r in self.replicas]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def _eject(self, r: Replica, why: str) -> None:
        now = time.monotonic()
        if r.healthy:
            r.ejections += 1
            log.warning("upstream %s ejected: %s", redact_url(r.url), why)
        r.healthy = False
        r.soft_failures = 0
        r.backoff_s = min(self.backoff_max_s, max(self.backoff_min_s, r.backoff_s * 2))
        r.ejected_until = now + r.backoff_s
        r.queued = 0
        r.wake.set()
        self.router.forget(r.index)

    async def _watch(self, r: Replica) -> None:
        while True:
            if not r.healthy:
                await asyncio.sleep(max(0.0, r.ejected_until - time.monotonic()))
            try:
                ok, why = await self._probe(r)
            except Exception as exc:  # a bug in one probe must not end the watcher
                ok, why = False, f"probe failed: {type(exc).__name__}"
            if ok:
                if not r.healthy:
                    r.healthy = True
                    log.warning("upstream %s readmitted after a passing health probe", redact_url(r.url))
                await self._scrape(r)
                r.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.health_interval_s):
                        await r.wake.wait()  # a request ejected it: on to the backoff probes now
            else:
                r.last_error = why
                self._eject(r, why)

    async def _probe(self, r: Replica) -> tuple[bool, str]:
        u = r.upstream
        try:
            async with asyncio.timeout(min(2.0, max(0.2, self.health_interval_s))):
                async with u.session.get(u.base_url + "/health", headers=u.headers) as resp:
                    await resp.read()
                    return resp.status < 500, f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"/health failed: {type(exc).__name__}"

    async def _scrape(self, r: Replica) -> None:
        if r.scrape == "no /metrics":
            return
        u = r.upstream
        try:
            async with asyncio.timeout(min(2.0, max(0.2, self.health_interval_s))):
                async with u.session.get(u.base_url + "/metrics", headers=u.headers) as resp:
                    if resp.status == 404:
                        r.scrape = "no /metrics"
                        return
                    raw = await resp.content.read(_MAX_METRICS_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            r.scrape = f"failed: {type(exc).__name__}"
            return
        r.queued = queue_depth(raw)
        r.scrape = "ok"

    def stats(self) -> list[dict]:
        return [r.view() for r in self.replicas]


def queue_depth(metrics_text: bytes) -> int:
    """The sum of the waiting-queue series in a Prometheus text (see `_WAITING`)."""
    total = 0.0
    for m in _WAITING.finditer(metrics_text):
        with contextlib.suppress(ValueError):
            total += float(m.group(1))
    return max(0, int(total))
