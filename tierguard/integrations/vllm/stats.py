"""The connector's metrics: tierguard's tier names, on a side endpoint of vLLM's engine core.

`ConnectorStats` nests the `TierStats` our own engine exports (hits per tier, loads,
recomputes, per-class deadline misses and stage failures, per-medium counters, transfer
routes), so every series has the name `tierguard serve` gives it (`tierguard:engine_kv_*`,
docs/vllm-connector.md lists them), plus what only the vLLM connector has: blocks reported to vLLM
as load errors, stores dropped by the full store queue, and the load latency histogram.

`serve_metrics(port, ...)` starts prometheus-client's HTTP server on a daemon thread; it
reads a stats snapshot per scrape and never runs on vLLM's threads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tierguard.common.histogram import LatencyHistogram
from tierguard.common.stats import COUNTER, counter, gauge, group, samples
from tierguard.kv.connector import TierStats

# Seconds from allocation to the load's end: a host hit is about a millisecond, a cold NVMe
# prefix tens of ms, a stalled tier the deadline.
LOAD_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
PREFIX = "tierguard:engine_kv_"


@dataclass
class ConnectorStats:
    load_error_blocks: int = counter(
        "Blocks reported to vLLM as failed loads (deadline missed, absent, corrupt, undecryptable); recomputed."
    )
    dropped_stores: int = counter("Finished requests whose blocks were not stored: the store queue was full.")
    dropped_store_blocks: int = counter("Blocks of dropped stores.")
    skipped_write_behind_blocks: int = counter("Host blocks not written behind: the store queue was full.")
    store_queue_blocks: int = gauge("Blocks being copied out of vLLM or written behind to a cold tier.")
    tiers: TierStats = group("", TierStats)
    load_latency: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(LOAD_BUCKETS))


def _name(sample_name: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", sample_name)


def families(stats: ConnectorStats, model_name: str) -> Iterator:
    """Prometheus metric families of one snapshot."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    for s in samples(stats):
        make = CounterMetricFamily if s.kind == COUNTER else GaugeMetricFamily
        fam = make(_name(s.name), s.doc, labels=["model_name"])
        fam.add_metric([model_name], s.value)
        yield fam
    h = HistogramMetricFamily(
        "tierguard:kv_load_latency_seconds",
        "From vLLM allocating a load's blocks to the load's end: copied in, or handed back to recompute.",
        labels=["model_name"],
    )
    h.add_metric([model_name], stats.load_latency.cumulative(), sum_value=stats.load_latency.total_s)
    yield h
    routes = HistogramMetricFamily(
        "tierguard:kv_transfer_latency_seconds",
        "KV tier transfer job latency per route.",
        labels=["model_name", "route"],
    )
    for route, hist in sorted(stats.tiers.latency.items()):
        routes.add_metric([model_name, route], hist.cumulative(), sum_value=hist.total_s)
    yield routes


def serve_metrics(port: int, host: str, read: Callable[[], ConnectorStats], model_name: str):
    """Start the side endpoint; returns (server, thread) for shutdown."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.registry import Collector

    class _Collector(Collector):
        def collect(self):
            yield from families(read(), model_name)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return start_http_server(port, addr=host, registry=registry)
