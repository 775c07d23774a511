"""Admission control: bounded queues, a long-session limit, and an honest "no" (R8, R15).

One library, two homes: `tierguard gate` (an OpenAI-compatible reverse proxy in front
of vLLM, SGLang, llama.cpp or our engine) and `tierguard serve` (in-process).

Embedding API (framework-free asyncio, see `admission.py` for the full contract)::

    from tierguard.gate import AdmissionController, AdmissionPolicy, RequestInfo
    from tierguard.gate import Downgrade, HandOff, Rejected

    controller = AdmissionController(AdmissionPolicy(max_concurrency=16, max_long=2))
    try:
        async with controller.admit(RequestInfo(input_tokens=n, priority="interactive",
                                                can_downgrade=is_chat)) as ticket:
            ...  # ticket.klass, ticket.queue_wait_s; the slot is freed on exit/cancel
    except Rejected as r:   # r.status (429, or 400 for input over the cap), r.reason,
        ...                 # r.retry_after_s -> error body + Retry-After header
    except Downgrade as d:  # trim to d.max_input_tokens (trim.trim_messages), retry
        ...                 # with RequestInfo(..., downgraded=True)
    except HandOff as h:    # store it as an async job (jobs.JobStore), answer 202
        ...

`controller.stats()` gives queue depth and in-flight per class and decision counts by
reason; `metrics.GateMetrics(controller)` exposes them to Prometheus.

Layout: policy (options + validation), admission (slots and queues), tokens (input
counting) + tokens_bound (the byte bound that skips most counts) + tokens_fit (the byte
rule that refuses what cannot fit, before counting), trim (context downgrade), jobs +
runner (async path on disk: owned by a key, sealed, expired), forward (upstream
streaming), http (errors, body limits, keys, tenants), proxy (handlers), reqlog (JSONL),
metrics, state + app (the running gate). Slow peers: tierguard/common/peers.py.
Several upstreams (docs/fleet.md): routing (policies, no HTTP) + prefix_index (what was sent
where), upstreams (health, ejection, the choice per attempt); limits shared through Redis:
leases (slots and queue places, Lua) + shared_admission (this interface over them, fallback).
Admission by predicted TTFT (`--admission predicted`): ttft_admission (the same interface) over
ttft_model (the closed form, calibration files, the online fit), ttft_upstream (work sent and
waiting per upstream), ttft_bookings (refused clients' places), ttft_shared (work across gates),
ttft_options.
"""

from tierguard.gate.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionStats,
    Downgrade,
    HandOff,
    Rejected,
    RequestInfo,
    Ticket,
)
from tierguard.gate.policy import AdmissionPolicy, GateSettings

__all__ = [
    "AdmissionController", "AdmissionDecision", "AdmissionPolicy", "AdmissionStats", "Downgrade",
    "GateSettings", "HandOff", "Rejected", "RequestInfo", "Ticket",
]
