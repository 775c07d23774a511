"""The completion handlers of the gate: read, count, admit, forward, log.

Order matters for reliability: the body is read (size limit, read timeout) and parsed
BEFORE admission, so a slow or broken client never holds a slot; the slot is released
in `finally`, so an error or a client disconnect (aiohttp cancels the handler) frees it.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from tierguard.common.errors import TierguardError
from tierguard.common.peers import BodyError
from tierguard.common.tokenpool import PoolBusy
from tierguard.gate.admission import Downgrade, HandOff, Rejected, RequestInfo
from tierguard.gate.forward import ENGINE_STATE_HEADER, UpstreamError, relay
from tierguard.gate.http import error_response, messages_problem, read_json, tenant
from tierguard.gate.isolation import apply_salt, bearer_key
from tierguard.gate.jobs import DISK_FULL, JobRefused
from tierguard.gate.reqlog import RequestRecord
from tierguard.gate.routing import RouteDecision
from tierguard.gate.runner import os_reason
from tierguard.gate.state import GATE, GateState
from tierguard.gate.tokens_fit import chat_bytes, text_bytes
from tierguard.gate.trim import can_trim, trim_messages
from tierguard.gate.ttft_bookings import request_key
from tierguard.gate.upstreams import SESSION_HEADER
from tierguard.kv.contract import CLASS_HEADER, CLASS_HEADER_ALIAS, classify_request

PRIORITY_HEADER = CLASS_HEADER  # the one request-class header; CLASS_HEADER_ALIAS also accepted
ASYNC_HEADER = "X-Tierguard-Async"
ASYNC_FLAG = "tierguard_async"  # body field; removed before forwarding
RETRY_STATUSES = (502, 503, 504)  # an upstream answer that is tried once more on another replica


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[GATE]
    arrived = time.monotonic()
    path = request.path
    as_async = path.startswith("/v1/async/")
    route = path.replace("/v1/async/", "/v1/", 1)
    chat = route.endswith("/chat/completions")
    rec = RequestRecord(route=route)
    try:
        body = await read_json(request, state.guard, state.max_body_bytes)
        problem = messages_problem(body.get("messages")) if chat else None
        if problem is not None:
            return _done(state, rec, arrived, error_response(400, problem), "bad_request")
        if not chat and "prompt" not in body:
            return _done(state, rec, arrived, error_response(400, "'prompt' is required"), "bad_request")
        refusal = _cannot_fit(state, body, chat)
        if refusal is not None:
            return _done(state, rec, arrived, error_response(400, refusal), "cannot_fit")
        try:  # before any path forwards it, async jobs included
            apply_salt(body, state.settings.cache_isolation, bearer_key(request.headers.get("Authorization", "")))
        except TierguardError as exc:
            return _done(state, rec, arrived, error_response(400, str(exc)), "bad_request")
        as_async = as_async or bool(body.pop(ASYNC_FLAG, False)) or request.headers.get(ASYNC_HEADER) == "1"
        rec.model = str(body.get("model")) if body.get("model") is not None else None
        rec.stream = bool(body.get("stream"))
        if state.reqlog.log_prompts:
            rec.prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))[:10_000]
        # The header, else the body's OpenAI/vLLM `priority` or `service_tier` (never its
        # `request_class`): the class is sent upstream in PRIORITY_HEADER, which serve obeys.
        priority = (request.headers.get(PRIORITY_HEADER) or request.headers.get(CLASS_HEADER_ALIAS)
                    or classify_request(body)).lower()
        if priority not in ("interactive", "batch"):
            return _done(state, rec, arrived, error_response(
                400, f"{PRIORITY_HEADER} must be 'interactive' or 'batch'"), "bad_request")
        counted = await state.counter.count_for_admission(body, chat, _decision_limit(state))
        n = rec.input_tokens = counted.tokens
        rec.token_count = counted.method
        state.metrics.child(state.metrics.token_counts, counted.method).inc()
        if as_async:
            return await _hand_off(state, request, route, body, n, rec, arrived, "requested")
        info = RequestInfo(input_tokens=n, priority=priority, can_downgrade=chat and can_trim(body.get("messages")),
                           key=_retry_key(state, request, body, n))
        rec.klass = state.controller.classify(info)
        ticket = None
        while ticket is None:
            try:
                ticket = await state.controller.acquire(info)
            except Downgrade as d:
                trimmed = await trim_messages(body["messages"], d.max_input_tokens, state.counter)
                if not trimmed.fits:
                    state.controller.record("reject", "downgrade_impossible")
                    return _done(state, rec, arrived, error_response(
                        429, d.message + "; the turns that must stay are still too long", retry_after_s=5),
                        "downgrade_impossible", "reject")
                body["messages"] = trimmed.messages
                rec.downgraded_from, rec.reason, rec.decision = n, d.reason, "downgrade"
                info = RequestInfo(input_tokens=trimmed.tokens, priority=priority, downgraded=True)
                rec.input_tokens = trimmed.tokens
                rec.klass = state.controller.classify(info)
            except HandOff as h:
                return await _hand_off(state, request, route, body, n, rec, arrived, h.reason)
            except Rejected as r:
                resp = error_response(r.status, r.message, retry_after_s=r.retry_after_s,
                                      etype="rate_limit_exceeded" if r.status == 429 else "invalid_request_error")
                resp.headers.update(getattr(r, "headers", None) or {})  # predicted admission's TTFT and wait
                return _done(state, rec, arrived, resp, r.reason, "reject")
        rec.queue_wait_ms = round(ticket.queue_wait_s * 1000, 3)
        state.metrics.child(state.metrics.queue_wait, ticket.klass).observe(ticket.queue_wait_s)
        try:
            return await _forward(state, request, route, body, rec, arrived, ticket, priority)
        finally:
            state.controller.release(ticket)
    except PoolBusy as exc:  # counting (or trimming) found the tokenizer queue full
        return _done(state, rec, arrived, error_response(503, f"{exc}; retry shortly", etype="server_busy",
                                                         retry_after_s=exc.retry_after_s), "tokenizer_busy")
    except RecursionError:  # a body nested just below the parser's limit, walked deeper by a later step
        return _done(state, rec, arrived, error_response(400, "the JSON body is nested too deeply"), "bad_request")
    except BodyError as exc:  # raised by read_json: 400/408/413
        resp = error_response(exc.status, exc.message)
        if exc.status != 400:
            resp.force_close()  # the rest of the body was not read: the connection cannot be reused
        return _done(state, rec, arrived, resp, {408: "body_timeout", 413: "too_large"}.get(exc.status, "bad_request"))
    except asyncio.CancelledError:
        rec.status, rec.reason = 499, rec.reason or "client_disconnected"
        _log(state, rec, arrived)
        raise


async def _forward(state: GateState, request: web.Request, route: str, body: dict, rec: RequestRecord,
                   arrived: float, ticket, priority: str = "interactive") -> web.StreamResponse:
    """Route, send, relay. An attempt that fails before its first byte reached the client is
    tried once more on another replica; a stream that already started ends with an error
    event instead (`relay`), so no client ever sees an answer twice."""
    headers = ticket.headers()
    if rec.downgraded_from is not None:
        headers["X-Tierguard-Downgraded"] = f"{rec.downgraded_from}->{rec.input_tokens}"
    fleet, payload = state.fleet, json.dumps(body).encode()
    target = fleet.request_for(body, route.endswith("/chat/completions"), request.headers.get(SESSION_HEADER))
    tried: list[int] = []
    result, dead = None, False
    pinned = getattr(ticket, "replica", None)  # predicted admission chose the upstream it priced
    while result is None:
        if pinned is not None and not tried:
            replica, decision = fleet.replicas[pinned], RouteDecision(pinned, "predicted")
            fleet.routed[(pinned, "predicted")] = fleet.routed.get((pinned, "predicted"), 0) + 1
        else:
            replica, decision = fleet.choose(target, tried)  # type: ignore[misc]  # never None on the first try
        tried.append(replica.index)
        can_retry = len(tried) < min(2, len(fleet.replicas))
        rec.upstream, rec.routed = replica.index, decision.reason  # the log always has them
        if len(fleet.replicas) > 1 and state.settings.route_headers:
            headers.update({"X-Tierguard-Replica": str(replica.index), "X-Tierguard-Route": decision.reason})
        replica.in_flight += 1
        try:
            upstream = await replica.upstream.post(route, payload, {PRIORITY_HEADER: priority})
            dead = upstream.headers.get(ENGINE_STATE_HEADER) == "dead"  # its engine stopped: eject now
            if upstream.status in RETRY_STATUSES and can_retry:  # refused before any byte: elsewhere
                upstream.close()
                _upstream_failed(state, replica, "engine_dead" if dead else f"status_{upstream.status}")
                continue
            result = await relay(request, upstream, headers, state.settings.first_byte_timeout_s,
                                 on_chunk_gap=state.metrics.itl.observe, guard=state.guard,
                                 on_first=getattr(ticket, "first_byte", None) if not tried[1:] else None)
        except UpstreamError as exc:  # nothing reached the client yet
            _upstream_failed(state, replica, exc.kind)
            if can_retry:
                continue
            return _done(state, rec, arrived, error_response(exc.status, exc.message, etype="upstream_error"),
                         rec.reason or f"upstream_{exc.kind}")
        finally:
            replica.in_flight -= 1
    if result.status >= 500:  # forwarded as is (the body or the stream's error event explains it), but counted
        state.metrics.upstream_errors.labels(f"status_{result.status}").inc()
        state.upstream_failures += 1
        if dead:
            fleet.failed(replica, "engine_dead")
        elif result.status in (502, 504):
            fleet.failed(replica, "timeout" if result.status == 504 else "status_502")
    else:
        state.upstream_failures = 0
        fleet.succeeded(replica)
    rec.status, rec.output_tokens = result.status, result.output_tokens
    if rec.token_count == "byte_bound" and result.prompt_tokens is not None:
        rec.input_tokens, rec.token_count = result.prompt_tokens, "upstream_usage"
    if result.first_chunk_at is not None:
        rec.ttft_ms = round((result.first_chunk_at - arrived) * 1000, 3)
        state.metrics.child(state.metrics.ttft, ticket.klass).observe(result.first_chunk_at - arrived)
    if result.client_left:
        rec.status, rec.reason = 499, "slow_reader" if result.slow_reader else "client_disconnected"
    rec.reason = rec.reason or "admitted"
    state.metrics.child(state.metrics.e2e, ticket.klass).observe(result.ended_at - arrived)
    _log(state, rec, arrived)
    return result.response


def _upstream_failed(state: GateState, replica, kind: str) -> None:
    state.metrics.upstream_errors.labels(kind).inc()
    state.upstream_failures += 1
    if kind != "status_503":  # busy is not broken: retried elsewhere, but no step towards ejection
        state.fleet.failed(replica, "timeout" if kind == "status_504" else kind)


def _retry_key(state: GateState, request: web.Request, body: dict, tokens: int) -> str | None:
    """The same for a retry of the same request: predicted admission keeps a rejected one's place."""
    if not getattr(state.controller, "prices_tokens", False):
        return None
    return request_key(body, tenant(request, state.settings.api_keys), tokens)


def _decision_limit(state: GateState) -> int:
    """The smallest input-token count that could change admission: long at the threshold,
    over the cap above max_input_tokens. Counts below it all decide alike. Predicted
    admission prices every prompt by its size: every count changes it."""
    if getattr(state.controller, "prices_tokens", False):
        return 1
    p = state.controller.policy
    return p.long_threshold if p.max_input_tokens is None else min(p.long_threshold, p.max_input_tokens + 1)


def _cannot_fit(state: GateState, body: dict, chat: bool) -> str | None:
    """The byte rule (`tokens_fit.py`): a refusal message for input that cannot fit, before counting."""
    rule, limit = state.token_bytes, state.max_model_len
    if rule is None or limit is None:
        return None
    nbytes = chat_bytes(body.get("messages")) if chat else text_bytes(body.get("prompt"))
    if nbytes is None or not rule.cannot_fit(nbytes, limit):
        return None
    state.guard.counters.byte_rule_refusals += 1
    return rule.refusal(nbytes, limit)


async def _hand_off(state: GateState, request: web.Request, route: str, body: dict, n: int, rec: RequestRecord,
                    arrived: float, reason: str) -> web.Response:
    """202 with the new job; or the quota's refusal (429/503/413, naming the limit), or 507
    when the disk is full. The job file is written in a thread (`JobRunner.create`)."""
    body.pop("stream", None)
    body.pop("stream_options", None)  # a job stores one whole answer
    try:
        job = await state.runner.create(route, body, n, owner=tenant(request, state.settings.api_keys))
    except JobRefused as exc:
        etype = "rate_limit_exceeded" if exc.status == 429 else "server_busy" if exc.status == 503 \
            else "invalid_request_error"
        return _done(state, rec, arrived, error_response(exc.status, exc.message, etype=etype,
                                                         retry_after_s=exc.retry_after_s), f"async_{exc.reason}", "reject")
    except OSError as exc:
        if exc.errno in DISK_FULL:
            return _done(state, rec, arrived, error_response(
                507, f"cannot store the async job: the jobs directory is full ({os_reason(exc)})",
                etype="insufficient_storage"), "async_disk_full", "reject")
        return _done(state, rec, arrived, error_response(
            503, f"cannot store the async job: {os_reason(exc)}", etype="server_busy", retry_after_s=5),
            "async_write_error", "reject")
    rec.job_id = job.id
    data = {**job.public(), "url": f"/v1/async/{job.id}", "reason": reason}
    return _done(state, rec, arrived, web.json_response(data, status=202, headers={"Location": f"/v1/async/{job.id}"}),
                 reason, "async")


def _done(state: GateState, rec: RequestRecord, arrived: float, resp: web.Response, reason: str,
          decision: str | None = None) -> web.Response:
    rec.status, rec.reason = resp.status, reason
    if decision is not None:
        rec.decision = decision
    elif resp.status >= 400:
        rec.decision = "error"
    _log(state, rec, arrived)
    return resp


def _log(state: GateState, rec: RequestRecord, arrived: float) -> None:
    rec.e2e_ms = round((time.monotonic() - arrived) * 1000, 3)
    state.metrics.child(state.metrics.responses, str(rec.status)).inc()
    state.reqlog.write(rec)
