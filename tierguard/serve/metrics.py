"""Prometheus metrics for `GET /metrics`.

Naming: where our meaning matches vLLM's we use vLLM's exact name (`vllm:` prefix),
so dashboards, alerts and `tierguard gate`/`bench` scrapers written for vLLM read us
unchanged; metrics vLLM has no equivalent for use the `tierguard:` prefix. Every
series carries a `model_name` label, as vLLM's do.

Three sources feed it:
- engine snapshots (`EngineStats`), read at scrape time by a collector, so gauges are
  never stale and counters are the engine's own cumulative totals. Its typed tier and
  policy stats (tierguard/common/stats.py) export as `tierguard:engine_kv_*`: fields
  declared as counters are Prometheus counters (`..._total`), the rest gauges;
- per-step reports (`StepStats`), pushed by the engine thread (prometheus-client
  metrics are thread-safe);
- per-request timings measured by the HTTP handler (TTFT, ITL, e2e).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tierguard.common.stats import COUNTER, samples
from tierguard.engine.api import AsyncEngine, StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector(Collector):
    """Reads one `EngineStats` snapshot per scrape."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_usage)
        yield self._gauge(
            "tierguard:kv_blocks_total", "KV cache blocks in the device pool.", s.kv_blocks_total
        )
        yield self._gauge("tierguard:kv_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used)
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield self._counter("vllm:num_preemptions", "Preemptions since start.", s.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens_total)
        yield self._counter(
            "vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens_total
        )
        yield self._gauge(
            "tierguard:engine_kv_blocks_cached",
            "Free device blocks still holding a prefix.",
            s.kv_blocks_cached,
        )
        yield self._counter(
            "tierguard:engine_kv_block_evictions",
            "Cached device blocks reused for other content.",
            s.kv_block_evictions,
        )
        yield self._gauge("tierguard:engine_kv_block_size", "Tokens per KV block.", s.kv_block_size)
        for key, value in sorted(s.extra.items()):
            yield self._gauge("tierguard:engine_" + _sanitize(key), f"Engine gauge {key!r}.", value)
        for sample in (*samples(s.tiers, "kv_"), *samples(s.policy, "kv_")):
            make = self._counter if sample.kind == COUNTER else self._gauge
            yield make("tierguard:engine_" + _sanitize(sample.name), sample.doc, sample.value)
        if s.histograms:
            h = HistogramMetricFamily(
                "tierguard:kv_transfer_latency_seconds",
                "KV tier transfer job latency per route (R13: a tier's device latency).",
                labels=["model_name", "route"],
            )
            for route, hist in sorted(s.histograms.items()):
                h.add_metric([self._model, route], hist.cumulative(), sum_value=hist.total_s)
            yield h


def _sanitize(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class ServeMetrics:
    """All metrics of one server, in a registry of its own (tests run many apps)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]
        self.registry.register(_EngineCollector(engine, model_name))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (server side).",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between consecutive output messages of a request.",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to last token.",
            lbl,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.req_prompt = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per request.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.req_gen = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per request.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.http = Counter(
            "tierguard:http_requests",
            "HTTP responses by route and status.",
            ["model_name", "route", "status"],
            registry=r,
        )
        self.step_duration = Histogram(
            "tierguard:step_duration_seconds",
            "Wall time of one engine step.",
            lbl,
            buckets=_STEP_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.step_prefill_seqs = Histogram(
            "tierguard:step_prefill_seqs",
            "Sequences prefilling per step.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.step_prefill_tokens = Histogram(
            "tierguard:step_prefill_tokens",
            "Prefill tokens per step.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.step_decode_seqs = Histogram(
            "tierguard:step_decode_seqs",
            "Sequences decoding per step.",
            lbl,
            buckets=_COUNT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.step_preempted = Counter(
            "tierguard:step_preempted_seqs", "Sequences preempted, summed over steps.", lbl, registry=r
        ).labels(model_name)

    def on_step(self, s: StepStats) -> None:
        """Step listener; runs on the engine thread, so it only touches thread-safe metrics."""
        self.step_duration.observe(s.duration_s)
        self.iteration_tokens.observe(s.num_prefill_tokens + s.num_decode_seqs)
        self.step_prefill_seqs.observe(s.num_prefill_seqs)
        self.step_prefill_tokens.observe(s.num_prefill_tokens)
        self.step_decode_seqs.observe(s.num_decode_seqs)
        if s.num_preempted:
            self.step_preempted.inc(s.num_preempted)

    def on_finished(self, reason: str | None, prompt_tokens: int, output_tokens: int, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(output_tokens)
        self.success.labels(self.model_name, reason or "unknown").inc()

    def on_aborted(self) -> None:
        """A request the server aborted (client gone, or failure) before it finished."""
        self.success.labels(self.model_name, "abort").inc()

    def on_response(self, route: str, status: int) -> None:
        self.http.labels(self.model_name, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
