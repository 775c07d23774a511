"""`run_bench(BenchConfig) -> BenchResult`: the Python API behind `tierguard bench`.

Order of a run: validate → preflight (server, model, quirks) → prompts and schedule →
fingerprint and environment → dispatch (one process, or `workers` processes that each
take every N-th request of the same seeded schedule) → token counts resolved off the
hot path → warm-up/cool-down marked → summary, time series → files. Results are written
on success, on server failure and on Ctrl-C alike (`interrupted` says which).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tierguard.bench import multiproc
from tierguard.bench.backend import resolve_token_counts
from tierguard.bench.config import BenchConfig, parse_window
from tierguard.bench.datasets import RequestSpec, build_requests, natural_count
from tierguard.bench.envinfo import collect_environment
from tierguard.bench.preflight import Preflight, preflight
from tierguard.bench.progress import LiveStats, brief
from tierguard.bench.prompts import PromptMaker, TokenizerPrompts, make_prompt_maker
from tierguard.bench.records import RequestRecord
from tierguard.bench.results import write_run
from tierguard.bench.selfcheck import assess, cpu_seconds
from tierguard.bench.stats import summarize, timeseries
from tierguard.bench.strategy import TraceArrivals, make_arrivals
from tierguard.bench.worker import WorkerPlan, loop_name, run_async, run_worker
from tierguard.common.errors import TierguardError

DEFAULT_REQUESTS = 100


@dataclass
class BenchResult:
    summary: dict
    run_info: dict
    records: list[RequestRecord] = field(default_factory=list)
    timeseries: list[dict] = field(default_factory=list)
    output_dir: Path | None = None
    interrupted: bool = False
    server_metrics: list[dict] = field(default_factory=list)  # /metrics scrapes, t relative to t0


def plan_requests(cfg: BenchConfig, maker: PromptMaker) -> tuple[list[RequestSpec], list[float]]:
    """The workload and its due times (offsets in s; zeros in closed loop)."""
    natural = natural_count(cfg)
    if cfg.dataset == "trace":
        specs = build_requests(cfg, maker, 0)
        offsets = TraceArrivals([s.arrival_s or 0.0 for s in specs]).schedule(cfg.num_requests, cfg.duration)
        return specs[: len(offsets)], offsets
    if cfg.closed_loop:
        n = cfg.num_requests or natural or DEFAULT_REQUESTS
        return build_requests(cfg, maker, n), [0.0] * n
    arrivals = make_arrivals(cfg.request_rate, cfg.burstiness, cfg.seed)
    n = cfg.num_requests or natural or (None if cfg.duration else DEFAULT_REQUESTS)
    offsets = arrivals.schedule(n, cfg.duration)
    specs = build_requests(cfg, maker, natural or len(offsets))[: len(offsets)]
    return specs, offsets[: len(specs)]


def profile_fingerprint(cfg: BenchConfig, model: str, specs: list[RequestSpec], offsets: list[float]) -> str:
    """Hash of everything that defines the workload: identical profiles ⇔ identical hashes.

    Included: endpoint, model, sampling, every prompt (hash), input/output length and due
    time, the concurrency limit, loop mode, duration and warm-up/cool-down. Excluded: where
    the server is, output paths, worker count, timeouts — they do not change the load."""
    h = hashlib.sha256()
    head = {"endpoint": cfg.endpoint, "model": model, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos,
            "max_concurrency": cfg.max_concurrency, "closed_loop": cfg.closed_loop, "duration": cfg.duration,
            "warmup": str(parse_window(cfg.warmup, "--warmup")), "cooldown": str(parse_window(cfg.cooldown, "--cooldown"))}
    h.update(json.dumps(head, sort_keys=True).encode())
    for s, off in zip(specs, offsets, strict=True):
        h.update(f"{s.prompt_sha}|{s.input_len}|{s.output_len}|{off:.6f}\n".encode())
    return h.hexdigest()[:32]


def worker_plans(cfg: BenchConfig, pf: Preflight, specs: list[RequestSpec], offsets: list[float]) -> list[WorkerPlan]:
    n = cfg.workers
    plans = []
    for w in range(n):
        conc = None if cfg.max_concurrency is None else cfg.max_concurrency // n + (w < cfg.max_concurrency % n)
        mine = specs[w::n]
        plans.append(WorkerPlan(
            worker=w, n_workers=n, base_url=cfg.base_url, endpoint=cfg.endpoint, model=pf.model, api_key=cfg.api_key,
            ignore_eos=cfg.ignore_eos, temperature=cfg.temperature, timeout_s=cfg.timeout, quirks=pf.quirks,
            specs=mine, offsets=offsets[w::n], concurrency=conc, closed_loop=cfg.closed_loop,
            duration_s=cfg.duration if cfg.closed_loop else None,
            max_requests=len(mine) if cfg.closed_loop and cfg.duration is None else None,
            preconnect=min(conc or 0, len(mine)), http_client=cfg.http_client))
    return plans


def mark_phases(records: list[RequestRecord], cfg: BenchConfig) -> list[RequestRecord]:
    """Tag warm-up/cool-down requests (kept in requests.jsonl) and return the measured ones."""
    order = sorted(records, key=lambda r: (r.scheduled_s, r.index))
    if not order:
        return []
    warm, cool = parse_window(cfg.warmup, "--warmup"), parse_window(cfg.cooldown, "--cooldown")
    first, last = order[0].scheduled_s, order[-1].scheduled_s
    for i, r in enumerate(order):
        if i < warm.requests or r.scheduled_s - first < warm.seconds:
            r.phase = "warmup"
        elif i >= len(order) - cool.requests or (cool.seconds and last - r.scheduled_s < cool.seconds):
            r.phase = "cooldown"
    return [r for r in order if r.phase == "measure"]


async def _single(cfg: BenchConfig, plan: WorkerPlan, live: LiveStats) -> tuple:
    stop = asyncio.Event()

    async def refresher() -> None:
        while True:
            live.refresh()
            await asyncio.sleep(0.5)

    async with multiproc.scraping_until_sigint(cfg, stop.set) as scraper:
        ticker = asyncio.get_running_loop().create_task(refresher())
        try:
            out = await run_worker(plan, lambda: time.monotonic() + 0.05, stop.is_set, lambda r: live.add(brief(r)))
        finally:
            ticker.cancel()
    return [out], scraper, stop.is_set()


def run_bench(cfg: BenchConfig) -> BenchResult:
    cfg.validate()
    headers = cfg.auth_headers
    run_info: dict = {"config": cfg.to_json(), "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out_dir = Path(cfg.output_dir) if cfg.output_dir else None
    try:
        pf = run_async(preflight(cfg))
        maker = make_prompt_maker(cfg.tokenizer, cfg.base_url, pf.model, headers)
        specs, offsets = plan_requests(cfg, maker)
        if not specs:
            raise TierguardError("the workload is empty (check --num-requests, --duration and --trace)")
    except TierguardError as exc:
        if out_dir:  # partial results: what was configured and why it stopped
            write_run(out_dir, {"completed": 0, "failed": 0, "error": str(exc)}, {**run_info, "error": str(exc)}, [])
        raise
    run_info.update({
        "model": pf.model,
        "profile_fingerprint": profile_fingerprint(cfg, pf.model, specs, offsets),
        "prompts": {"source": maker.source, "exact": maker.exact, "tokenizer": maker.identity,
                    "count": len(specs), "mode": "closed-loop" if cfg.closed_loop else "open-loop"},
        "environment": collect_environment(cfg.base_url, headers, loop_name()),
    })
    plans = worker_plans(cfg, pf, specs, offsets)
    live = LiveStats(None if cfg.duration and cfg.closed_loop else len(specs), cfg.show_progress)
    parent_cpu0 = cpu_seconds()
    try:
        if cfg.workers == 1:
            outputs, scraper, interrupted = run_async(_single(cfg, plans[0], live))
        else:
            outputs, scraper, interrupted = multiproc.run_workers(cfg, plans, live)
    finally:
        live.close()
    parent_cpu = cpu_seconds() - parent_cpu0  # only the parent's own work when workers > 1
    records = sorted((r for o in outputs for r in o.records), key=lambda r: (r.scheduled_s, r.index))
    counter = maker.chunk_token_counts if isinstance(maker, TokenizerPrompts) else None
    for r in records:
        resolve_token_counts(r, counter)
    measured = mark_phases(records, cfg)
    summary = summarize(measured, cfg.slo)
    health = [o.health for o in outputs if o.health]
    check = assess(health, [r.send_lateness_ms for r in records if r.send_lateness_ms is not None], len(records),
                   cfg.max_send_lateness_ms, cfg.max_loop_lag_ms, cfg.max_client_cpu_util,
                   parent_cpu if cfg.workers > 1 else 0.0)
    quirks = outputs[0].quirks if outputs and outputs[0].quirks else pf.quirks
    summary.update(check)
    summary.update({
        "date": run_info["started_at"], "model_id": pf.model, "endpoint": cfg.endpoint,
        "request_rate": cfg.request_rate, "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "mode": run_info["prompts"]["mode"], "warmup_excluded": sum(r.phase == "warmup" for r in records),
        "cooldown_excluded": sum(r.phase == "cooldown" for r in records), "interrupted": interrupted,
        "prompt_lengths": "exact" if maker.exact else "approximate",
        "profile_fingerprint": run_info["profile_fingerprint"],
        "quirks": {"dropped_fields": sorted({f for o in outputs for f in (o.quirks.dropped_fields if o.quirks else [])}
                                            | set(pf.quirks.dropped_fields)),
                   "sends_done": quirks.sends_done, "sends_usage": quirks.sends_usage,
                   "continuous_usage": quirks.continuous_usage,
                   "requests_retried": sum(bool(r.retried_without) for r in records)},
        "server_metrics": scraper.highlights(),
        "worker_errors": [o.worker_error for o in outputs if o.worker_error],
    })
    run_info["self_check"] = check
    run_info["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = outputs[0].t0 if outputs else 0.0
    run_info["t0_monotonic"] = t0
    run_info["preconnected"] = sum(o.preconnected for o in outputs)
    ts = timeseries(records)
    series = scraper.relative_to(t0)
    if out_dir:
        write_run(out_dir, summary, run_info, records, ts, series)
    return BenchResult(summary, run_info, records, ts, out_dir, interrupted, series)
