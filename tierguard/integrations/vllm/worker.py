"""The worker side of the vLLM connector: copies between vLLM's KV cache and the shared slab.

It holds no tier. Everything a step names is already in host RAM (loads) or has a slot
reserved for it (stores), so the worker only submits copies to its own `TransferWorker`
(tierguard's device <-> host handler, `DevicePool.copy_blocks`) and reports what ended:

    start(ops)        submit this step's copies (never waits for one)
    finished(ids)     loads done (finished receiving), stores done for requests vLLM has
                      declared finished (finished sending); never waits
    load_errors()     target blocks of loads that were abandoned, failed, or whose staged
                      blocks did not arrive; handed out no later than their request

A load's target blocks belong to a request vLLM holds in WAITING_FOR_REMOTE_KVS and a
store's source blocks to a finished request whose blocks vLLM keeps until finished
sending, so no forward pass reads or writes them while a copy runs.

Every entry point runs under `decode_guard()`: a tier read reached from a forward pass
raises `ColdContractViolation` instead of stalling every running stream.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

import tierguard.integrations.vllm.shm as shm
from tierguard.common.errors import TierguardError
from tierguard.integrations.vllm.layout import BlockGeometry, device_pool
from tierguard.integrations.vllm.ops import StepOps, WorkerReport
from tierguard.kv.copy_handlers import DeviceHostCopy
from tierguard.kv.guard import decode_guard
from tierguard.kv.media import DeviceBlocks, HostSlots
from tierguard.kv.media.host import HostTier
from tierguard.kv.spec import DevicePool
from tierguard.kv.transfer import TransferSpec, TransferWorker

log = logging.getLogger("tierguard.integrations.vllm")


class _InferenceCopy(DeviceHostCopy):
    """tierguard's device <-> host copy, in inference mode: vLLM creates its KV cache (and
    the worker maps the slab) under `torch.inference_mode()`, whose tensors refuse in-place
    writes from outside it."""

    def run(self, spec: TransferSpec, prepared: object) -> list[bool]:
        with torch.inference_mode():
            return super().run(spec, prepared)


@dataclass
class _Job:
    kind: str  # "load" | "store"
    req_id: str
    block_ids: list[int]  # device blocks the copy writes (load) or reads (store)
    error_block_ids: list[int]


class TierWorker:
    def __init__(self, geometry: BlockGeometry, num_threads: int = 1) -> None:
        self.geometry = geometry
        self.num_threads = num_threads
        self.pool: DevicePool | None = None
        self.transfer: TransferWorker | None = None
        self._slab_key: tuple[str, int, int] | None = None
        self._fingerprint: str | None = None
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._recved: set[str] = set()
        self._storing: set[str] = set()  # requests with a store copy submitted, not yet reported
        self._sent: set[str] = set()  # store copies done
        self._finished_reqs: set[str] = set()  # requests of `_storing` vLLM declared finished
        self._errors_pending: dict[str, list[int]] = {}  # by request, until it is reported
        self._errors_out: set[int] = set()
        self._failed_stores: set[str] = set()
        self._attached: set[str] = set()  # slabs mapped since the last report

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.pool = device_pool(kv_caches, self.geometry)

    def _attach(self, ops: StepOps) -> None:
        """Map the scheduler's slab on first use (it is created by the other process)."""
        if self._fingerprint is None:
            self._fingerprint = ops.fingerprint
        elif ops.fingerprint != self._fingerprint:
            raise TierguardError("TierguardConnector: the scheduler's fingerprint changed mid-run")
        key = (ops.slab, ops.num_slots, ops.block_bytes)
        if key == self._slab_key:
            return
        if self.pool is None:
            raise TierguardError("TierguardConnector: vLLM did not register its KV caches")
        if ops.block_bytes != self.pool.block_bytes:
            raise TierguardError(
                f"TierguardConnector: scheduler blocks of {ops.block_bytes} bytes, worker {self.pool.block_bytes}"
            )
        slab = shm.open_slab(Path(ops.slab), ops.num_slots, ops.block_bytes)
        host = HostTier(ops.num_slots * ops.block_bytes, ops.block_bytes, slab=slab)
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = TransferWorker(ops.block_bytes, num_threads=self.num_threads)
        self.transfer.register_handler(
            DeviceBlocks, HostSlots, _InferenceCopy(self.pool, host, to_device=False)
        )
        self.transfer.register_handler(
            HostSlots, DeviceBlocks, _InferenceCopy(self.pool, host, to_device=True)
        )
        self._slab_key = key
        self._attached.add(ops.slab)

    def start(self, ops: StepOps | None) -> None:
        with decode_guard():
            if ops is None or not (ops.loads or ops.stores):
                return
            self._attach(ops)
            for op in ops.loads:
                if not op.block_ids:
                    self._recved.add(op.req_id)
                    self._errors_pending[op.req_id] = list(op.error_block_ids)
                    continue
                spec = TransferSpec(HostSlots(list(op.slots)), DeviceBlocks(list(op.block_ids)))
                self._submit(_Job("load", op.req_id, list(op.block_ids), list(op.error_block_ids)), spec)
            for st in ops.stores:
                spec = TransferSpec(DeviceBlocks(list(st.block_ids)), HostSlots(list(st.slots)))
                self._storing.add(st.req_id)
                self._submit(_Job("store", st.req_id, list(st.block_ids), []), spec)

    def _submit(self, job: _Job, spec: TransferSpec) -> None:
        assert self.transfer is not None
        self._next_job += 1
        self._jobs[self._next_job] = job
        self.transfer.transfer_async(self._next_job, spec)

    def _poll(self) -> None:
        if self.transfer is None:
            return
        for done in self.transfer.get_finished():
            job = self._jobs.pop(done.job_id)
            if job.kind == "load":
                errors = list(job.error_block_ids)
                if not done.success:  # the copy itself failed: its blocks are recomputed
                    errors += [b for b, ok in zip(job.block_ids, done.block_ok, strict=True) if not ok]
                    log.warning("tierguard connector: load copy for %s failed: %s", job.req_id, done.error)
                self._recved.add(job.req_id)
                self._errors_pending[job.req_id] = errors
            else:
                if not done.success:
                    self._failed_stores.add(job.req_id)
                self._sent.add(job.req_id)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call; never waits."""
        with decode_guard():
            self._finished_reqs |= finished_req_ids & self._storing
            self._poll()
            recved, self._recved = self._recved, set()
            for req_id in recved:
                self._errors_out.update(self._errors_pending.pop(req_id, ()))
            sent = self._sent & self._finished_reqs
            self._sent -= sent
            self._finished_reqs -= sent
            self._storing -= sent
            return sent, recved

    def load_errors(self) -> set[int]:
        out, self._errors_out = self._errors_out, set()
        return out

    def report(self) -> WorkerReport | None:
        if not (self._failed_stores or self._attached):
            return None
        out = WorkerReport(self._failed_stores, self._attached)
        self._failed_stores, self._attached = set(), set()
        return out

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()
