"""The remedy ladder (R7): cheapest fix first, stop at the first step that makes it fit.

    1 trim history        -> what context fits; applied only down to --trim-to
    2 prefix caching      -> a shared prefix is stored once (--shared-prefix)
    3 KV quantization     -> fp8 / q8_0; check quality on LONG-context tasks
    4 limit long sessions -> how many fit at once; applied only down to --min-concurrency
    5 RAM KV offload      -> overflow parked in host RAM (reload costs TTFT)
    6 weight offload      -> last: costs every forward pass (TPOT/ITL)

Steps are cumulative. All VRAM quantities are bytes on the most loaded GPU.
Invariant: the returned steps end with the first one whose `fits` is true (or run
out); steps after it are not applied and not listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierguard.common.units import GIB
from tierguard.plan.kv import KVModel


@dataclass
class Workload:
    context: int  # tokens per sequence at its longest (context + output)
    concurrency: int
    trim_to: int | None = None
    shared_prefix: int = 0
    min_concurrency: int | None = None  # None: the full concurrency is required


@dataclass
class LadderState:
    kvm: KVModel
    vram: int  # KV bytes available per GPU (negative when weights alone overflow)
    context: int
    sessions: int  # sessions that must be active at once
    total_sessions: int
    gpus: int
    prefix: int = 0
    kv_ram_total: int = 0  # host bytes, all ranks together
    weights_off_per_gpu: int = 0

    def seq(self) -> int:
        return self.kvm.sequence_bytes_per_gpu(self.context)

    def prefix_saving(self) -> int:
        return self.kvm.shared_prefix_bytes_per_gpu(min(self.prefix, self.context)) if self.prefix else 0

    def need(self, sessions: int | None = None) -> int:
        n = self.sessions if sessions is None else sessions
        return n * self.seq() - max(0, n - 1) * self.prefix_saving()

    def vram_total(self) -> int:
        return self.vram + self.weights_off_per_gpu

    def fits(self) -> bool:
        over = self.need() - self.vram_total()
        if over <= 0:
            return True
        # Offloaded KV only parks idle sessions: one active sequence must still fit in VRAM.
        return self.seq() <= self.vram_total() and self.kv_ram_total >= over * self.gpus

    def sessions_that_fit(self) -> int:
        s, p, v = self.seq(), self.prefix_saving(), self.vram_total()
        if s > v:
            return 0
        return min(self.total_sessions, 1 + (v - s) // max(1, s - p))


@dataclass
class Step:
    step: str
    number: int
    saves_bytes: int
    fits: bool
    applied: bool
    detail: str
    values: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "number": self.number,
            "saves_bytes": int(self.saves_bytes),
            "fits": self.fits,
            "applied": self.applied,
            "detail": self.detail,
            **self.values,
        }


def _gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB"


def run_ladder(
    st: LadderState,
    wl: Workload,
    quant: KVModel | None,
    kv_host_budget: int,
    weights_host_budget: int,
    weights_per_gpu: int,
) -> list[Step]:
    """Apply steps in order to `st` (mutated) until the workload fits."""
    steps: list[Step] = []
    if st.fits():
        return steps

    def record(name: str, before: int, applied: bool, detail: str, **values) -> bool:
        saves = before - st.need() if applied else 0
        steps.append(Step(name, len(steps) + 1, saves, st.fits(), applied, detail, values))
        return st.fits()

    # 1. Trim history.
    before = st.need()
    fit_ctx = st.kvm.max_context(max(0, st.vram_total()), st.sessions, st.context)
    applied = wl.trim_to is not None and wl.trim_to < st.context
    if applied:
        st.context = wl.trim_to
        detail = f"history trimmed to {wl.trim_to} tokens; {fit_ctx} tokens per session would fit"
    else:
        detail = f"{fit_ctx} tokens per session fit for {st.sessions} sessions; allow trimming with --trim-to"
    if record("trim_history", before, applied, detail, context_that_fits=fit_ctx):
        return steps

    # 2. Prefix caching.
    before = st.need()
    applied = wl.shared_prefix > 0 and st.sessions > 1
    if applied:
        st.prefix = wl.shared_prefix
        detail = f"a {wl.shared_prefix}-token shared prefix is stored once instead of {st.sessions} times"
    else:
        detail = (
            "no shared prefix given (--shared-prefix); prefix caching skips prefill, it is not free decode"
        )
    if record("prefix_caching", before, applied, detail, shared_prefix_tokens=wl.shared_prefix):
        return steps

    # 3. KV quantization.
    before = st.need()
    if quant is not None:
        st.kvm = quant
        fit_ctx = st.kvm.max_context(max(0, st.vram_total()), st.sessions, st.context)
        detail = (
            f"KV as {quant.s.fmt.name}: {st.sessions_that_fit()} sessions or {fit_ctx} tokens each now fit; "
            f"validate quality on long-context tasks, not only a general benchmark"
        )
        done = record(
            "kv_quantization", before, True, detail, kv_dtype=quant.s.fmt.name, context_that_fits=fit_ctx
        )
    else:
        done = record(
            "kv_quantization", before, False, "KV already 8 bit or less, or quantization not allowed"
        )
    if done:
        return steps

    # 4. Limit concurrent long sessions.
    before = st.need()
    k = st.sessions_that_fit()
    floor_n = wl.min_concurrency if wl.min_concurrency is not None else st.sessions
    applied = k >= max(1, floor_n) and k < st.sessions
    if applied:
        st.sessions = k
        detail = f"at most {k} long sessions at once; the rest wait in a bounded queue (R8)"
    else:
        detail = f"{k} long sessions fit at once; allow a limit with --min-concurrency"
    if record("limit_long_sessions", before, applied, detail, sessions_that_fit=k):
        return steps

    # 5. RAM KV offload: overflow beyond VRAM parks in host RAM, if one session fits in VRAM.
    before = st.need()
    over_total = max(0, st.need() - st.vram_total()) * st.gpus
    one_fits = st.seq() <= st.vram_total()
    if one_fits and kv_host_budget > 0:
        st.kv_ram_total = min(over_total, kv_host_budget)
        detail = (
            f"{_gib(over_total)} of KV (all ranks) parks in host RAM; budget {_gib(kv_host_budget)}; "
            f"a reload costs TTFT, never read inside decode"
        )
    else:
        detail = (
            "not even one session fits in VRAM: offloaded KV cannot help"
            if not one_fits
            else "no host RAM budget for KV offload"
        )
    steps.append(
        Step(
            "ram_kv_offload",
            len(steps) + 1,
            min(over_total, st.kv_ram_total) // st.gpus,
            st.fits(),
            st.kv_ram_total > 0,
            detail,
            {"kv_offload_bytes": over_total, "kv_offload_budget_bytes": kv_host_budget},
        )
    )
    if st.fits():
        return steps

    # 6. Weight offload (last).
    deficit = max(st.need() - st.kv_ram_total // st.gpus - st.vram_total(), st.seq() - st.vram_total(), 0)
    cap = min(int(weights_per_gpu * 0.9), weights_host_budget // st.gpus)
    # Engines take GiB; round the request up to 0.25 GiB so the flag really frees enough.
    want = math.ceil(deficit / (GIB / 4)) * (GIB // 4)
    st.weights_off_per_gpu = min(want, cap)
    detail = (
        f"{_gib(want)} of weights per GPU to host RAM (cap {_gib(cap)}); every forward pass "
        f"reads them over PCIe: TPOT/ITL grow"
    )
    steps.append(
        Step(
            "weight_offload",
            len(steps) + 1,
            st.weights_off_per_gpu,
            st.fits(),
            st.weights_off_per_gpu > 0,
            detail,
            {"weights_offload_bytes_per_gpu": want, "weights_offload_cap_bytes_per_gpu": cap},
        )
    )
    return steps
