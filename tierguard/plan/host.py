"""Host RAM budget (R6): reserves first, a pinned-memory cap, and two separate offload budgets.

    total ──┬── OS + services reserve      max(4 GiB, 8%)
            ├── page-cache reserve         max(4 GiB, 10%)
            ├── tokenizer/network/bursts   max(2 GiB, 5%)
            └── usable ──┬── pinned cap (half of usable: not all free RAM is pinned)
                         │     ├── KV-offload budget      (its own limit)
                         │     └── weight-offload budget  (its own limit; pinned UVA
                         │                                 costs 1.15–1.9× the figure)
                         └── left for everything else

Limits come from the allowed p99, not from DIMM size: these defaults are an upper bound
the ladder may use, and users narrow them with --kv-offload-gib / --weights-offload-gib.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tierguard.common.units import GIB

PIN_FACTOR_LOW = 1.15  # vLLM --cpu-offload-gb real host use, best case
PIN_FACTOR_HIGH = 1.9  # ... and worst case


def _reserve(total: int, floor_gib: float, fraction: float) -> int:
    return min(total, max(int(floor_gib * GIB), int(total * fraction)))


@dataclass
class HostBudget:
    total_bytes: int
    source: str  # "given" or "this machine"
    os_reserve_bytes: int
    page_cache_reserve_bytes: int
    services_reserve_bytes: int
    usable_bytes: int
    pinned_cap_bytes: int
    kv_offload_budget_bytes: int
    weights_offload_budget_bytes: int
    kv_limit_given: bool
    weights_limit_given: bool
    offload_requested: str = "none"
    # Filled by settle() once the ladder chose what to offload.
    kv_offload_bytes: int = 0
    weights_offload_bytes: int = 0  # figure passed to the engine, all GPUs together
    weights_offload_host_bytes: int = 0  # with worst-case pinning overhead
    pinned_bytes: int = 0
    left_bytes: int = 0
    nvme_bytes: int | None = None
    kv_disk_budget_bytes: int = 0
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def host_budget(
    total_bytes: int | None,
    *,
    kv_limit: int | None = None,
    weights_limit: int | None = None,
    offload: str = "none",
    pinned_cap: int | None = None,
    nvme_bytes: int | None = None,
) -> HostBudget:
    source = "given"
    if total_bytes is None:
        import psutil

        total_bytes, source = int(psutil.virtual_memory().total), "this machine"
    os_r = _reserve(total_bytes, 4, 0.08)
    cache_r = _reserve(total_bytes - os_r, 4, 0.10)
    svc_r = _reserve(total_bytes - os_r - cache_r, 2, 0.05)
    usable = max(0, total_bytes - os_r - cache_r - svc_r)
    cap = usable // 2 if pinned_cap is None else pinned_cap
    kv_budget = kv_limit if kv_limit is not None else cap // 2
    w_budget = weights_limit if weights_limit is not None else int(cap / 2 / PIN_FACTOR_HIGH)
    hb = HostBudget(
        total_bytes,
        source,
        os_r,
        cache_r,
        svc_r,
        usable,
        cap,
        kv_budget,
        w_budget,
        kv_limit is not None,
        weights_limit is not None,
        offload,
        nvme_bytes=nvme_bytes,
    )
    if nvme_bytes:
        hb.kv_disk_budget_bytes = int(nvme_bytes * 0.8)  # keep 20% free: full disks stall writers
    if (
        kv_limit is not None
        and weights_limit is not None
        and kv_limit + weights_limit * PIN_FACTOR_LOW > usable
    ):
        hb.warnings.append(
            f"--kv-offload-gib + --weights-offload-gib (x{PIN_FACTOR_LOW} pinning) exceed the usable "
            f"{usable / GIB:.1f} GiB of host RAM left after OS, page-cache and service reserves"
        )
    return hb


def settle(hb: HostBudget, kv_offload: int, weights_offload: int) -> HostBudget:
    """Record what the plan offloads and warn where budgets are crossed."""
    hb.kv_offload_bytes = kv_offload
    hb.weights_offload_bytes = weights_offload
    hb.weights_offload_host_bytes = int(weights_offload * PIN_FACTOR_HIGH)
    hb.pinned_bytes = kv_offload + hb.weights_offload_host_bytes
    hb.left_bytes = hb.usable_bytes - hb.pinned_bytes
    both = hb.offload_requested == "both" or (kv_offload > 0 and weights_offload > 0)
    if both and not (hb.kv_limit_given and hb.weights_limit_given):
        hb.warnings.append(
            "both KV offload and weight offload are requested without separate limits: give each its own "
            "budget (--kv-offload-gib and --weights-offload-gib) so one cannot starve the other"
        )
    if hb.pinned_bytes > hb.pinned_cap_bytes:
        hb.warnings.append(
            f"pinned host memory would reach {hb.pinned_bytes / GIB:.1f} GiB (KV {kv_offload / GIB:.1f} + "
            f"weights {weights_offload / GIB:.1f} x{PIN_FACTOR_HIGH}), above the {hb.pinned_cap_bytes / GIB:.1f} GiB "
            f"cap: page cache and other processes will starve"
        )
    return hb
