"""Weight offload: decoder layers kept in host memory and streamed in before use.

The last resort of R7 with its own budget (R6), separate from KV offload. Unlike KV
offload, which costs a reload after a miss, weight offload costs every forward pass
(R1): each offloaded layer is copied host -> device once per step, so its price shows
up in TPOT/ITL and in the `weights_offload_*` gauges.

Mechanism. The last `k` decoder layers are offloaded. Each one's parameters are packed
into one flat host buffer (pinned on CUDA). On the device there are `min(k, 2)` staging
slots, each one layer's worth of flat storage; offloaded layer j's parameters are
permanent views into slot `j % 2`, so nothing is rebound at run time, only slot
contents change. Forward pre-hooks drive the pipeline:

    pre-hook(layer j):   wait until layer j's copy landed; start copying layer j+1 into
                         the other slot (its previous user, layer j-1, is done)
    post-hook(last):     start copying the first offloaded layer for the next step

On CUDA the copies run on a side stream; the compute stream waits on a per-copy event,
and the side stream waits on an event recorded after the slot's previous user, so the
host never blocks. On CPU the "device" is host memory too: copies run on one worker
thread (overlapping compute as far as the free cores allow), and what is measured is the copy
cost only, not a PCIe transfer. Device memory saved is `(k - slots) x layer bytes`,
which is zero for k <= 2.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.model.llama import LlamaModel


@dataclass
class WeightOffloadStats:
    layers: int  # decoder layers kept in host memory
    host_bytes: int  # bytes of layer weights held in host memory
    device_bytes_saved: int  # offloaded bytes minus the staging slots
    copies_total: int  # layer copies issued (one per offloaded layer per step)
    copy_bytes_total: int
    copy_seconds_total: float  # time spent copying (CPU: wall time; CUDA: event time)
    wait_seconds_total: float  # time the compute path waited for a copy (CPU)

    def as_gauges(self) -> dict[str, float]:
        return {
            "weights_offload_layers": float(self.layers),
            "weights_offload_bytes": float(self.host_bytes),
            "weights_offload_device_bytes_saved": float(self.device_bytes_saved),
            "weights_offload_copies_total": float(self.copies_total),
            "weights_offload_copy_bytes_total": float(self.copy_bytes_total),
            "weights_offload_copy_seconds_total": self.copy_seconds_total,
            "weights_offload_wait_seconds_total": self.wait_seconds_total,
        }


def layer_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def layers_for_budget(model: LlamaModel, budget_gib: float) -> int:
    """How many decoder layers fit in `budget_gib`; raises TierguardError when none or too many."""
    per_layer = layer_bytes(model.layers[0])
    n = len(model.layers)
    total = per_layer * n
    budget = int(budget_gib * GIB)
    if budget < 0:
        raise TierguardError(f"--weights-offload-gib must be >= 0, got {budget_gib}")
    if budget > total:
        raise TierguardError(
            f"--weights-offload-gib {budget_gib} exceeds the model's decoder layer weights "
            f"({total / GIB:.4f} GiB in {n} layers of {per_layer / 2**20:.2f} MiB); use at most that"
        )
    k = budget // per_layer
    if budget and k == 0:
        raise TierguardError(
            f"--weights-offload-gib {budget_gib} is smaller than one decoder layer "
            f"({per_layer / 2**20:.2f} MiB = {per_layer / GIB:.6f} GiB)"
        )
    return int(k)


class WeightOffloader:
    """Streams the last `num_layers` decoder layers of `model` from host memory; see module doc."""

    def __init__(self, model: LlamaModel, num_layers: int) -> None:
        n = len(model.layers)
        if not 0 < num_layers <= n:
            raise TierguardError(f"can offload 1..{n} decoder layers, asked for {num_layers}")
        self.model = model
        self.layer_ids = list(range(n - num_layers, n))
        first = model.layers[self.layer_ids[0]]
        self.device = next(first.parameters()).device
        self.dtype = next(first.parameters()).dtype
        self._cuda = self.device.type == "cuda"
        shapes = [(name, p.shape) for name, p in first.named_parameters()]
        self._numel = sum(s.numel() for _, s in shapes)
        self.layer_bytes = self._numel * torch.empty((), dtype=self.dtype).element_size()
        self.num_slots = min(num_layers, 2)
        self._slots = [
            torch.empty(self._numel, dtype=self.dtype, device=self.device) for _ in range(self.num_slots)
        ]
        self._host: list[torch.Tensor] = []
        for j, i in enumerate(self.layer_ids):
            self._host.append(self._detach_layer(model.layers[i], shapes, self._slots[j % self.num_slots]))
        # Pipeline state. Invariant: `_owner[s]` is the offloaded layer whose bytes slot s
        # holds or is receiving; `_pending[j]` is the handle of layer j's outstanding copy.
        self._owner: list[int | None] = [None] * self.num_slots
        self._pending: dict[int, object] = {}
        self._copies = 0
        self._copy_bytes = 0
        self._copy_seconds = 0.0
        self._wait_seconds = 0.0
        self._lock = threading.Lock()
        self._timing_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        if self._cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._executor = None
        else:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-offload")
        self._hooks = []
        for j, i in enumerate(self.layer_ids):
            self._hooks.append(model.layers[i].register_forward_pre_hook(self._make_pre_hook(j)))
        self._hooks.append(model.layers[self.layer_ids[-1]].register_forward_hook(self._post_hook))
        model.weight_offloader = self
        if self._cuda:
            # Hand the freed layer weights back, so the KV budget measured next sees them.
            torch.cuda.empty_cache()

    @classmethod
    def attach(cls, model: LlamaModel, budget_gib: float | None) -> WeightOffloader | None:
        """Offload as many trailing layers as `budget_gib` holds; None when 0/None."""
        if not budget_gib:
            if budget_gib is not None and budget_gib < 0:
                raise TierguardError(f"--weights-offload-gib must be >= 0, got {budget_gib}")
            return None
        return cls(model, layers_for_budget(model, budget_gib))

    def _detach_layer(self, layer: nn.Module, shapes: list, slot: torch.Tensor) -> torch.Tensor:
        """Move `layer`'s weights into one flat host buffer; rebind them as views of `slot`."""
        params = list(layer.named_parameters())
        if [(name, p.shape) for name, p in params] != shapes or any(p.dtype != self.dtype for _, p in params):
            raise TierguardError("weight offload needs decoder layers of identical shapes and dtype")
        flat = torch.cat([p.detach().reshape(-1).to("cpu") for _, p in params])
        if self._cuda:
            flat = flat.pin_memory()
        _bind(layer, slot)
        return flat

    # ---- the pipeline ----

    def _make_pre_hook(self, j: int):
        def hook(_module: nn.Module, _args: tuple) -> None:
            self._ensure(j)
            if j + 1 < len(self.layer_ids):
                self._prefetch(j + 1)

        return hook

    def _post_hook(self, _module: nn.Module, _args: tuple, _output: object) -> None:
        self._prefetch(0)

    def _prefetch(self, j: int) -> None:
        """Start copying offloaded layer j into its slot. The slot's previous user has
        finished (CPU) or is ordered before the copy by an event (CUDA)."""
        slot = j % self.num_slots
        if self._owner[slot] == j and j in self._pending:
            return
        for other in [o for o in self._pending if o % self.num_slots == slot and o != j]:
            self._wait(other)  # never two copies into one slot at once
        self._owner[slot] = j
        self._copies += 1
        self._copy_bytes += self.layer_bytes
        src, dst = self._host[j], self._slots[slot]
        if self._cuda:
            free = torch.cuda.Event()
            free.record()  # after everything the compute stream queued so far
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(free)
                start.record(self._stream)
                dst.copy_(src, non_blocking=True)
                done.record(self._stream)
            self._timing_events.append((start, done))
            self._pending[j] = done
        else:
            self._pending[j] = self._executor.submit(self._copy_cpu, src, dst)

    def _copy_cpu(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            dst.copy_(src)
        with self._lock:
            self._copy_seconds += time.perf_counter() - t0

    def _ensure(self, j: int) -> None:
        """Make layer j's weights visible to the compute path before it runs."""
        if j not in self._pending:
            # Not prefetched: the first step, or after a failed forward. Copied even when
            # the slot still holds j from an earlier step, so the cost stays per step.
            self._prefetch(j)
        self._wait(j)

    def _wait(self, j: int) -> None:
        handle = self._pending.pop(j, None)
        if handle is None:
            return
        if isinstance(handle, Future):
            t0 = time.perf_counter()
            handle.result()
            self._wait_seconds += time.perf_counter() - t0
        else:
            torch.cuda.current_stream(self.device).wait_event(handle)

    # ---- observation ----

    def stats(self) -> WeightOffloadStats:
        if self._cuda:
            still = []
            for start, done in self._timing_events:
                if done.query():
                    self._copy_seconds += start.elapsed_time(done) / 1000.0
                else:
                    still.append((start, done))
            self._timing_events = still
        with self._lock:
            seconds = self._copy_seconds
        k = len(self.layer_ids)
        return WeightOffloadStats(
            layers=k,
            host_bytes=k * self.layer_bytes,
            device_bytes_saved=max(0, k - self.num_slots) * self.layer_bytes,
            copies_total=self._copies,
            copy_bytes_total=self._copy_bytes,
            copy_seconds_total=seconds,
            wait_seconds_total=self._wait_seconds,
        )

    def detach(self) -> None:
        """Stop offloading: every offloaded layer gets its own device weights back."""
        for j in list(self._pending):
            self._wait(j)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for j, i in enumerate(self.layer_ids):
            _bind(self.model.layers[i], self._host[j].to(self.device, copy=True))
        self.model.weight_offloader = None


def _bind(layer: nn.Module, flat: torch.Tensor) -> None:
    """Make `layer`'s parameters consecutive views of `flat` (in named_parameters order)."""
    offset = 0
    for name, p in list(layer.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = layer.get_submodule(module_name) if module_name else layer
        view = flat[offset : offset + p.numel()].view(p.shape)
        setattr(module, attr, nn.Parameter(view, requires_grad=False))
        offset += p.numel()
