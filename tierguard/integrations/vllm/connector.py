"""`TierguardConnector`: tierguard's KV tiers and cold contract as a vLLM v1 KV connector.

    --kv-transfer-config '{"kv_connector": "TierguardConnector",
        "kv_connector_module_path": "tierguard.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_disk_dir": "/nvme/kv", "kv_disk_gib": 100}}'

vLLM builds one instance per role: the scheduler role in the engine-core process
(scheduler.py: tiers, index, deadlines, stores) and the worker role in each worker
process (worker.py: copies between the KV cache and the shared host slab). They talk
only through `TierguardMetadata` (scheduler -> worker, every step) and vLLM's connector
output (finished sending / receiving, load-error block ids, `TierguardWorkerMeta`).

This module only translates vLLM's objects into plain values; the policy lives in the
scheduler side, so it is tested without vLLM. The hooks and what they keep:

    get_num_new_matched_tokens   index lookup only: (tokens, True) or (0, False)
    update_state_after_alloc     start the load (async; the request waits in vLLM)
    build_connector_meta         this step's loads, abandoned loads, stores
    start_load_kv                submit copies of bytes already in host RAM (never waits)
    wait_for_layer_load,
    save_kv_layer                nothing: loads land before the request runs, stores
                                 copy whole blocks after it ends
    get_finished                 copies that ended; get_block_ids_with_load_errors: the
                                 blocks vLLM must recompute
    request_finished             queue the store of a finished request's full blocks
                                 (True keeps its blocks until the copy ends)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierguard.integrations.vllm.config import parse_config
from tierguard.integrations.vllm.layout import (
    RequestHashes,
    checkpoint_digest,
    geometry_from_spec,
    request_salt,
    vllm_fingerprint,
)
from tierguard.integrations.vllm.ops import StepOps, WorkerReport
from tierguard.kv.contract import BATCH, classify_request

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("tierguard.integrations.vllm")


def _log_through_vllm() -> None:
    """tierguard's loggers write where vLLM's do (vLLM configures only its own)."""
    ours, theirs = logging.getLogger("tierguard"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class TierguardMetadata(KVConnectorMetadata):
    def __init__(self, ops: StepOps) -> None:
        self.ops = ops


class TierguardWorkerMeta(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierguardWorkerMeta)
        return TierguardWorkerMeta(self.report.merge(other.report))


def _geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
    from vllm.v1.kv_cache_interface import AttentionSpec

    if vllm_config.parallel_config.world_size != 1:
        raise ValueError("TierguardConnector supports one worker per engine (tensor and pipeline parallel 1)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        raise ValueError("TierguardConnector supports models with one full-attention KV cache group")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None):
        raise ValueError("TierguardConnector does not support sliding-window KV caches")
    stored = {name for t in kv_cache_config.kv_cache_tensors for name in getattr(t, "layers", ())}
    names = list(groups[0].layer_names)
    shared = {n: "" for n in names if stored and n not in stored}
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None) or ""
    return geometry_from_spec(
        names,
        spec.block_size,
        spec.num_kv_heads,
        spec.head_size,
        spec.dtype,
        spec.page_size_bytes,
        str(layout),
        shared,
    )


class TierguardConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        self.config = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self.geometry = _geometry(vllm_config, kv_cache_config)
        self.block_size = self.geometry.block_size
        self.scheduler = None
        self.worker = None
        self._metrics = None
        if role == KVConnectorRole.SCHEDULER:
            from tierguard.integrations.vllm.scheduler import TierScheduler

            mc = vllm_config.model_config
            hf = mc.hf_text_config.to_dict() if hasattr(mc.hf_text_config, "to_dict") else {}
            # The checkpoint's content, not its path: a fine-tune in the same directory is
            # another model (layout.py).
            weights = checkpoint_digest(
                str(mc.model), getattr(mc, "revision", None), getattr(vllm_config.load_config, "download_dir", None)
            )
            self.fingerprint = vllm_fingerprint(
                weights, hf, self.geometry, str(mc.dtype), str(getattr(mc, "quantization", None) or "")
            )
            engine_id = str(self._kv_transfer_config.engine_id or "engine")
            self.scheduler = TierScheduler(
                self.config, self.fingerprint, self.geometry.block_bytes, engine_id
            )
            self._hashes: dict[str, RequestHashes] = {}
            self._matched: dict[str, int] = {}  # request -> first block the load covers
            log.info(
                "TierguardConnector: fingerprint %s, %d-byte blocks of %d tokens, host %d slots, media %s, "
                "load deadlines %s ms",
                self.fingerprint, self.geometry.block_bytes, self.block_size, self.scheduler.host.num_slots,
                list(self.scheduler.media) or "none", self.config.load_deadline_ms,
            )  # fmt: skip
            if self.config.metrics_port:
                from tierguard.integrations.vllm.stats import serve_metrics

                name = mc.served_model_name if isinstance(mc.served_model_name, str) else str(mc.model)
                self._metrics = serve_metrics(
                    self.config.metrics_port, self.config.metrics_host, self.scheduler.stats, name
                )
        else:
            from tierguard.integrations.vllm.worker import TierWorker

            self.worker = TierWorker(self.geometry)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    # ---- worker role ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        self.worker.start(meta.ops if isinstance(meta, TierguardMetadata) else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sent, recved = self.worker.finished(finished_req_ids)
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.report() if self.worker is not None else None
        return TierguardWorkerMeta(report) if report else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            if self._metrics is not None:
                self._metrics[0].shutdown()
            self.scheduler.close()

    # ---- scheduler role ----

    def _request_hashes(self, request: Request) -> RequestHashes | None:
        if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return None  # KV that token ids alone do not name
        h = self._hashes.get(request.request_id)
        if h is None:
            h = self._hashes[request.request_id] = RequestHashes(
                request_salt(self.fingerprint, getattr(request, "cache_salt", None)), self.block_size
            )
        return h

    def _request_class(self, request: Request) -> str:
        params = request.kv_transfer_params or {}
        if any(params.get(k) is not None for k in ("priority", "service_tier")):
            return classify_request(params)
        if request.priority > 0:  # vLLM's integer priority: lower is more urgent
            return BATCH
        return self.config.default_class

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        h = self._request_hashes(request)
        if h is None:
            return 0, False
        # At least one prompt token is computed by vLLM itself (it samples from it).
        hashes = h.upto(request.all_token_ids, request.num_tokens - 1)
        start = num_computed_tokens // self.block_size
        n = self.scheduler.lookup(request.request_id, hashes, start)
        if n == 0:
            return 0, False
        self._matched[request.request_id] = start
        return n * self.block_size, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        start = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or start is None:
            return
        n = num_external_tokens // self.block_size
        h = self._hashes[request.request_id]
        block_ids = blocks.get_block_ids()[0]
        self.scheduler.begin_load(
            request.request_id,
            self._request_class(request),
            h.hashes[start : start + n],
            block_ids[start : start + n],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return TierguardMetadata(self.scheduler.build_ops())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, TierguardWorkerMeta) else None
        self.scheduler.on_output(
            set(connector_output.finished_recving or ()), set(connector_output.finished_sending or ()), report
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self._matched.pop(request.request_id, None)
        h = self._request_hashes(request)
        self._hashes.pop(request.request_id, None)
        if h is None:
            return False, None
        hashes = h.upto(request.all_token_ids, request.num_computed_tokens)
        return self.scheduler.finish(request.request_id, hashes, list(block_ids)), None

    def reset_cache(self) -> bool | None:
        if self.scheduler is None:
            return None
        self.scheduler.reset_host()
        return True

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return {CacheHitSource.DISK: num_external_tokens} if num_external_tokens else {}
