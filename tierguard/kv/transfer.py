"""Asynchronous transfer worker: moves block payloads between device, host and disk.

`transfer_async` only enqueues; the copy runs on a worker thread, and on CUDA on that
thread's own stream, ordered after the caller's current stream by an event. The caller
learns the outcome from `get_finished()`, which never waits. So no engine step ever
blocks on a transfer: a step that needs blocks simply does not schedule their sequence
until the job is reported finished.

Routes (source medium, destination medium):
    DEVICE -> HOST   copy pool block `device_block` into host slot `host_slot`
    HOST -> DEVICE   the reverse
    HOST -> DISK     write host slot `host_slot` as disk block `block_hash`
    DISK -> HOST     read disk block `block_hash` into host slot `host_slot`
The worker owns no bookkeeping: pinning the slots a job touches is the manager's job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tierguard.common.histogram import LatencyHistogram
from tierguard.kv.disk_tier import DiskTier
from tierguard.kv.faults import FaultInjector
from tierguard.kv.host_tier import HostTier
from tierguard.kv.spec import DevicePool, Medium

log = logging.getLogger("tierguard.kv.transfer")

Route = tuple[Medium, Medium]


@dataclass
class BlockTransfer:
    block_hash: int
    host_slot: int
    device_block: int | None = None  # required for routes touching the device


@dataclass
class TransferSpec:
    src: Medium
    dst: Medium
    blocks: list[BlockTransfer]

    @property
    def route(self) -> Route:
        return (self.src, self.dst)


@dataclass
class TransferResult:
    """Outcome of one job. `block_ok[i]` says whether `spec.blocks[i]` arrived intact."""

    job_id: int
    success: bool
    block_ok: list[bool]
    seconds: float
    route: Route
    error: str = ""


@dataclass
class RouteStats:
    jobs: int = 0
    failed_jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=2048))
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # all jobs, for /metrics


class TransferWorker:
    """Thread pool that runs transfer jobs; see module docstring for the routes."""

    def __init__(
        self,
        host: HostTier,
        pool: DevicePool | None = None,
        disk: DiskTier | None = None,
        num_threads: int = 2,
        faults: FaultInjector | None = None,
    ) -> None:
        self.host, self.pool, self.disk = host, pool, disk
        self.faults = faults or FaultInjector()
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kv-transfer")
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._in_flight: set[int] = set()
        self._cuda = pool is not None and pool.tensors[0].is_cuda
        self._local = threading.local()
        self.route_stats: dict[Route, RouteStats] = {}
        self._handlers: dict[Route, Callable[[TransferSpec], list[bool]]] = {
            (Medium.DEVICE, Medium.HOST): self._device_to_host,
            (Medium.HOST, Medium.DEVICE): self._host_to_device,
            (Medium.HOST, Medium.DISK): self._host_to_disk,
            (Medium.DISK, Medium.HOST): self._disk_to_host,
        }

    # ---- caller side (never blocks on a transfer) ----

    def transfer_async(self, job_id: int, spec: TransferSpec) -> None:
        """Enqueue a job. Raises ValueError for a route this worker cannot serve."""
        if spec.route not in self._handlers:
            raise ValueError(f"unsupported transfer route {spec.src.value}->{spec.dst.value}")
        if Medium.DEVICE in spec.route and self.pool is None:
            raise ValueError("device transfers need a device pool")
        if Medium.DISK in spec.route and self.disk is None:
            raise ValueError("disk transfers need a disk tier")
        ready = None
        if self._cuda and spec.src is Medium.DEVICE:
            # The copy must see every write the caller's stream has queued to these blocks.
            ready = torch.cuda.Event()
            ready.record()
        with self._lock:
            if job_id in self._in_flight:
                raise ValueError(f"transfer job {job_id} is already in flight")
            self._in_flight.add(job_id)
        self._executor.submit(self._run, job_id, spec, ready)

    def get_finished(self) -> list[TransferResult]:
        """Jobs completed since the last call, in completion order."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def latency_histograms(self) -> dict[str, LatencyHistogram]:
        """A copy of each route's job latency histogram, keyed "src_to_dst"."""
        with self._lock:
            return {f"{src.value}_to_{dst.value}": rs.latency.snapshot() for (src, dst), rs in self.route_stats.items()}

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- worker side ----

    def _run(self, job_id: int, spec: TransferSpec, ready: torch.cuda.Event | None) -> None:
        start = time.perf_counter()
        error = ""
        try:
            self.faults.check("transfer")
            if ready is not None:
                self._stream().wait_event(ready)
            block_ok = self._handlers[spec.route](spec)
        except Exception as e:  # a failed job is a miss for the caller, never a crash
            log.warning("transfer job %s %s->%s failed: %s", job_id, spec.src.value, spec.dst.value, e)
            block_ok, error = [False] * len(spec.blocks), str(e)
        seconds = time.perf_counter() - start
        result = TransferResult(job_id, all(block_ok), block_ok, seconds, spec.route, error)
        with self._lock:
            stats = self.route_stats.setdefault(spec.route, RouteStats())
            stats.jobs += 1
            stats.failed_jobs += 0 if result.success else 1
            stats.blocks += sum(block_ok)
            stats.bytes += sum(block_ok) * self.host.block_bytes
            stats.latencies_s.append(seconds)
            stats.latency.observe(seconds)
            self._in_flight.discard(job_id)
            self._finished.append(result)

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream()
        return stream

    def _copy(self, spec: TransferSpec, to_device: bool) -> list[bool]:
        if self.pool is None:
            raise ValueError("device transfers need a device pool")
        for b in spec.blocks:
            if b.device_block is None:
                raise ValueError(f"block {b.block_hash:#x} has no device block id")
            self.pool.copy_block(b.device_block, self.host.slot_view(b.host_slot), to_device, self._cuda)
        return [True] * len(spec.blocks)

    def _device_to_host(self, spec: TransferSpec) -> list[bool]:
        return self._copy_on_stream(spec, to_device=False)

    def _host_to_device(self, spec: TransferSpec) -> list[bool]:
        return self._copy_on_stream(spec, to_device=True)

    def _copy_on_stream(self, spec: TransferSpec, to_device: bool) -> list[bool]:
        if not self._cuda:
            return self._copy(spec, to_device)
        with torch.cuda.stream(self._stream()):
            ok = self._copy(spec, to_device)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # this worker thread waits; the caller never does
        return ok

    def _host_to_disk(self, spec: TransferSpec) -> list[bool]:
        if self.disk is None:
            raise ValueError("disk transfers need a disk tier")
        items = [(b.block_hash, self.host.slot_view(b.host_slot)) for b in spec.blocks]
        return self.disk.write_many(items)

    def _disk_to_host(self, spec: TransferSpec) -> list[bool]:
        if self.disk is None:
            raise ValueError("disk transfers need a disk tier")
        return self.disk.read_many([(b.block_hash, self.host.slot_view(b.host_slot)) for b in spec.blocks])
