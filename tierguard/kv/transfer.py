"""Asynchronous transfer worker: runs block copies between media on its own threads.

`transfer_async` only enqueues; the copy runs on a worker thread (on CUDA, on that
thread's own stream). The caller learns the outcome from `get_finished()`, which never
waits. So no engine step ever blocks on a transfer: a step that needs blocks simply does
not schedule their sequence until the job is reported finished.

Routes are open: a handler is registered for a (source spec class, destination spec
class) pair (see media.py), as vLLM's `OffloadingWorker.register_handler`. The built-in
handlers live in copy_handlers.py: device <-> host (one batched copy per job) and
host <-> any cold medium. The worker owns no bookkeeping: pinning what a job touches is
the manager's job, and a job's blocks arrive (or fail) together, reported per block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierguard.common.histogram import LatencyHistogram
from tierguard.common.stats import counter, gauge, quantile_ms
from tierguard.kv.faults import FaultInjector
from tierguard.kv.media import BlockSpec
from tierguard.kv.store_policy import StorePolicy

log = logging.getLogger("tierguard.kv.transfer")

# How long the store lane sleeps when its share of the cores is spent.
STORE_RETRY_S = 0.002


@dataclass
class TransferSpec:
    """Copy `len(src)` blocks: `src`'s i-th block becomes `dst`'s i-th block."""

    src: BlockSpec
    dst: BlockSpec

    def __post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise ValueError(
                f"transfer {self.route_name}: {len(self.src)} source blocks, {len(self.dst)} targets"
            )

    @property
    def route(self) -> tuple[type[BlockSpec], type[BlockSpec]]:
        return (type(self.src), type(self.dst))

    @property
    def route_name(self) -> str:
        return f"{self.src.medium}_to_{self.dst.medium}"


class TransferHandler:
    """Moves the bytes of one route. `prepare` runs on the caller's thread at submit and
    must not block (on CUDA it records what the copy must wait for); `run` runs on a
    worker thread and returns one bool per block (True: arrived intact)."""

    def prepare(self, spec: TransferSpec) -> object:
        return None

    def run(self, spec: TransferSpec, prepared: object) -> list[bool]:
        raise NotImplementedError


@dataclass
class TransferResult:
    """Outcome of one job. `block_ok[i]` says whether block i of the spec arrived intact."""

    job_id: int
    success: bool
    block_ok: list[bool]
    seconds: float
    route: str  # "src_to_dst"
    error: str = ""


@dataclass
class RouteStats:
    jobs: int = counter("Transfer jobs finished on this route.")
    failed_jobs: int = counter("Transfer jobs on this route with a failed block.")
    blocks: int = 0
    bytes: int = counter("Block bytes moved on this route.")
    p50_ms: float = gauge("Median job latency over the recent window, ms.")
    p99_ms: float = gauge("p99 job latency over the recent window, ms.")


@dataclass
class _Route:
    stats: RouteStats = field(default_factory=RouteStats)
    window: deque[float] = field(default_factory=lambda: deque(maxlen=2048))
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # all jobs, for /metrics


class TransferWorker:
    """Thread pool that runs transfer jobs through registered handlers.

    Three lanes:
      - promotions (loads, swap-outs) run at once on `num_threads` threads;
      - stores (`store=True`: copies nobody waits for yet) run one at a time on their own
        thread, each only when `store_policy.allow_run()` says the stores' share of the
        cores is not spent (store_policy.py);
      - stores that hold device blocks until they end (`holds_device=True`: a finished
        sequence's offload to host RAM) run one at a time on a third thread and are
        charged to the same share, but never wait for it or behind a write-behind. Their
        source blocks cannot be reused while they wait, so a queue of them behind slow
        disk writes would leave a new request without blocks: exactly the wait a store
        must never cause.
    A store never delays a promotion.
    """

    def __init__(
        self,
        block_bytes: int,
        num_threads: int = 2,
        faults: FaultInjector | None = None,
        store_policy: StorePolicy | None = None,
    ) -> None:
        self.block_bytes = block_bytes
        self.faults = faults or FaultInjector()
        self.store_policy = store_policy or StorePolicy()
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kv-transfer")
        self._store_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store")
        self._offload_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._in_flight: set[int] = set()
        self._routes: dict[str, _Route] = {}
        self._handlers: dict[tuple[type[BlockSpec], type[BlockSpec]], TransferHandler] = {}

    def register_handler(self, src: type[BlockSpec], dst: type[BlockSpec], handler: TransferHandler) -> None:
        self._handlers[(src, dst)] = handler

    # ---- caller side (never blocks on a transfer) ----

    def transfer_async(self, job_id: int, spec: TransferSpec, store: bool = False, holds_device: bool = False) -> None:
        """Enqueue a job: on the store lane when `store`, on the offload lane when it also
        `holds_device` blocks until it ends. Raises ValueError for a route no handler serves."""
        handler = self._handlers.get(spec.route)
        if handler is None:
            raise ValueError(f"unsupported transfer route {spec.route_name}")
        prepared = handler.prepare(spec)
        with self._lock:
            if job_id in self._in_flight:
                raise ValueError(f"transfer job {job_id} is already in flight")
            self._in_flight.add(job_id)
        if store and holds_device:
            self._offload_executor.submit(self._run_charged, job_id, spec, handler, prepared)
        elif store:
            self._store_executor.submit(self._run_store, job_id, spec, handler, prepared)
        else:
            self._executor.submit(self._run, job_id, spec, handler, prepared)

    def get_finished(self) -> list[TransferResult]:
        """Jobs completed since the last call, in completion order."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def latency_histograms(self) -> dict[str, LatencyHistogram]:
        """A copy of each route's job latency histogram, keyed "src_to_dst"."""
        with self._lock:
            return {name: r.latency.snapshot() for name, r in self._routes.items()}

    def route_stats(self) -> dict[str, RouteStats]:
        with self._lock:
            routes = {name: (r.stats, list(r.window)) for name, r in self._routes.items()}
        out = {}
        for name, (s, lat) in routes.items():
            out[name] = RouteStats(
                s.jobs, s.failed_jobs, s.blocks, s.bytes, quantile_ms(lat, 0.5), quantile_ms(lat, 0.99)
            )
        return out

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def shutdown(self) -> None:
        self._closing.set()  # queued stores run now, without waiting for their share
        self._offload_executor.shutdown(wait=True)
        self._store_executor.shutdown(wait=True)
        self._executor.shutdown(wait=True)

    # ---- worker side ----

    def _run_store(self, job_id: int, spec: TransferSpec, handler: TransferHandler, prepared: object) -> None:
        while not self._closing.is_set() and not self.store_policy.allow_run():
            self._closing.wait(STORE_RETRY_S)
        self._run_charged(job_id, spec, handler, prepared)

    def _run_charged(self, job_id: int, spec: TransferSpec, handler: TransferHandler, prepared: object) -> None:
        cpu = time.thread_time()
        self._run(job_id, spec, handler, prepared)
        # The share is of the cores: waiting for a device (fsync, a socket) costs none of it.
        self.store_policy.charge(time.thread_time() - cpu)

    def _run(self, job_id: int, spec: TransferSpec, handler: TransferHandler, prepared: object) -> float:
        start = time.perf_counter()
        error = ""
        try:
            self.faults.check("transfer")
            block_ok = handler.run(spec, prepared)
        except Exception as e:  # a failed job is a miss for the caller, never a crash
            log.warning("transfer job %s %s failed: %s", job_id, spec.route_name, e)
            block_ok, error = [False] * len(spec.src), str(e)
        seconds = time.perf_counter() - start
        result = TransferResult(job_id, all(block_ok), block_ok, seconds, spec.route_name, error)
        with self._lock:
            route = self._routes.setdefault(spec.route_name, _Route())
            s = route.stats
            s.jobs += 1
            s.failed_jobs += 0 if result.success else 1
            s.blocks += sum(block_ok)
            s.bytes += sum(block_ok) * self.block_bytes
            route.window.append(seconds)
            route.latency.observe(seconds)
            self._in_flight.discard(job_id)
            self._finished.append(result)
        return seconds
