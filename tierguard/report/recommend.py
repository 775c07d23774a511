"""Turn boundaries into decisions, in the article's terms (R14, R7, R4, R5).

Rules read the boundary per context, the prefix-reuse slice and the variants' tags
(reference, no-tier, host-tier, disk-prefix, fp8, naive-sync-disk); each rule fires only
when the numbers support it, and every sentence quotes the numbers it rests on. The
order follows the article: admission limits first, then long sessions, what NVMe is for,
prefix reuse, KV quantization before offload, and the RAM tier last.
"""

from __future__ import annotations

from tierguard.report.load import RunData, VariantData
from tierguard.report.tables import fmt_ms, prefix_p50_ttft
from tierguard.sweep.cells import CellSpec, CellVerdict


def _best(v: VariantData, ctx: int) -> int | None:
    return (v.boundaries.get(ctx) or {}).get("max_concurrency")


def _tagged(data: RunData, tag: str) -> VariantData | None:
    return next((v for v in data.variants if tag in v.tags and v.boundaries), None)


def _b(x: int | None) -> str:
    return "none" if x is None else str(x)


def recommendations(data: RunData) -> list[str]:
    ctxs = sorted(data.matrix.profile.context_lengths)
    done = [v for v in data.variants if v.boundaries]
    out: list[str] = []
    for v in data.variants:
        if v.status == "failed":
            out.append(f"{v.name} did not run ({v.error}); it has no boundary.")
    if not done:
        return out
    out += _limits(done, ctxs)
    out += _long_sessions(data, done, ctxs)
    out += _nvme(data, ctxs[-1])
    out += _prefix(data)
    out += _tier_cost(data, ctxs[-1])
    out += _quantize_and_ram(data, ctxs[-1])
    return out


def _limits(done: list[VariantData], ctxs: list[int]) -> list[str]:
    out = []
    for ctx in ctxs:
        top = max((x for x in (_best(v, ctx) for v in done) if x is not None), default=None)
        if top is None:
            out.append(
                f"At {ctx} tokens no variant meets the SLOs even alone: lower the maximum context "
                "or move such requests to an asynchronous mode."
            )
            continue
        names = [v.name for v in done if _best(v, ctx) == top]
        ceiling = all((v.boundaries.get(ctx) or {}).get("ceiling_reached") for v in done if v.name in names)
        bound = f"at least {top} (the ladder's top)" if ceiling else str(top)
        out.append(
            f"At {ctx} tokens, {', '.join(names)} hold{'s' if len(names) == 1 else ''} the SLOs up to "
            f"concurrency {bound}; admit no more than that per replica (a bounded queue, not an open one)."
        )
    return out


def _long_sessions(data: RunData, done: list[VariantData], ctxs: list[int]) -> list[str]:
    if len(ctxs) < 2:
        return []
    short, long = ctxs[0], ctxs[-1]
    first = _tagged(data, "reference")
    for v in ([first] if first else []) + done:
        bs, bl = _best(v, short), _best(v, long)
        if bs is not None and (bl is None or bl < bs):
            return [
                f"Long contexts leave the SLO first ({v.name}: {_b(bl)} at {long} tokens vs {bs} at "
                f"{short}): give long sessions a separate pool, or their own lower concurrency limit, "
                "instead of one max_model_len for everyone."
            ]
    return []


def _first_miss(v: VariantData, ctx: int) -> CellVerdict | None:
    first = (v.boundaries.get(ctx) or {}).get("first_failing")
    return v.cells.get(CellSpec("ladder", ctx, first).key) if first is not None else None


def _nvme(data: RunData, long: int) -> list[str]:
    naive, disk = _tagged(data, "naive-sync-disk"), _tagged(data, "disk-prefix")
    if naive is None or disk is None:
        return []
    n, d = _best(naive, long), _best(disk, long)
    if (n or 0) >= (d or 0):
        return [
            f"Reading NVMe inside the decode loop ({naive.name}) did not lower the boundary at {long} "
            f"tokens here ({_b(n)} vs {_b(d)} for {disk.name}); its reads may be served from the page cache."
        ]
    detail = ""
    miss = _first_miss(naive, long)
    if miss is not None:
        # The contract's cell at the same load, or the nearest heavier one it ran.
        heavier = [c for c in disk.ladder(long) if c.concurrency >= miss.concurrency]
        twin = heavier[0] if heavier else None
        twin_itl = ""
        if twin is not None:
            at = "" if twin.concurrency == miss.concurrency else f" at concurrency {twin.concurrency}"
            twin_itl = f" vs {fmt_ms(twin.p99['itl'].value)} ms under the contract{at}"
        detail = (
            f" (at concurrency {miss.concurrency} its p99 ITL is {fmt_ms(miss.p99['itl'].value)} ms"
            f"{twin_itl})"
        )
    return [
        f"Reading NVMe synchronously in the decode loop ({naive.name}) lowers the boundary at {long} tokens "
        f"from {_b(d)} to {_b(n)}{detail}: use NVMe only as a prefix cache and a cold tier loaded before "
        f"the answer starts ({disk.name}), never as an extension of VRAM."
    ]


def _prefix_cell(v: VariantData) -> CellVerdict | None:
    cells = sorted((c for c in v.cells.values() if c.slice == "prefix"), key=lambda c: c.concurrency)
    return cells[0] if cells else None


def _prefix(data: RunData) -> list[str]:
    bare = next((v for v in data.variants if "no-tier" in v.tags and _prefix_cell(v)), None)
    tiered = [v for v in data.variants if {"host-tier", "disk-prefix"} & set(v.tags) and _prefix_cell(v)]
    if bare is None or not tiered:
        return []
    cb = _prefix_cell(bare)
    pb = prefix_p50_ttft(data, bare, cb)  # type: ignore[arg-type]
    if pb is None:
        return []
    out = []
    for v in tiered:
        c = _prefix_cell(v)
        p = prefix_p50_ttft(data, v, c)  # type: ignore[arg-type]
        if p is None:
            continue
        p99, p99b = c.p99["ttft"].value, cb.p99["ttft"].value  # type: ignore[union-attr]
        if p < pb:
            both = f"{fmt_ms(p99)} vs {fmt_ms(p99b)} ms"
            if 0.9 * p99b <= p99 <= 1.1 * p99b:
                tail = f"; p99 about the same ({both}): the first use of each prefix, which no tier helps"
            elif p99 > p99b:
                tail = (
                    f"; its p99 is worse ({both}): the tier's background copies share the machine "
                    "with compute, so size them from p99, not from the median"
                )
            else:
                tail = f", p99 {both}"
            out.append(
                f"Repeated prefixes: {v.name} turns recompute into loads - p50 TTFT {fmt_ms(p)} ms against "
                f"{fmt_ms(pb)} ms for {bare.name}, which recomputes evicted prefixes{tail}."
            )
        else:
            out.append(
                f"Repeated prefixes: {v.name} did not beat recompute here (p50 TTFT {fmt_ms(p)} vs "
                f"{fmt_ms(pb)} ms for {bare.name}); on this machine loading a prefix costs as much as "
                "computing it, so a prefix tier is not worth its budget."
            )
    return out


def _tier_cost(data: RunData, long: int) -> list[str]:
    """A tier is not free: its copies share the machine with compute. Say so when the
    ladder (no reuse) shows it."""
    bare = next((v for v in data.variants if "no-tier" in v.tags and v.boundaries), None)
    if bare is None or _best(bare, long) is None:
        return []
    b = _best(bare, long) or 0
    slower = [
        v
        for v in data.variants
        if {"host-tier", "disk-prefix"} & set(v.tags) and v.boundaries and (_best(v, long) or 0) < b
    ]
    if not slower:
        return []
    names = ", ".join(f"{v.name} {_b(_best(v, long))}" for v in slower)
    return [
        f"Without reuse a tier only costs: on unique prompts at {long} tokens the boundary is {names} "
        f"against {b} for {bare.name}, since offload copies share the machine with compute. Enable a "
        "tier for traffic that repeats prefixes or resumes sessions, not by default."
    ]


def _quantize_and_ram(data: RunData, long: int) -> list[str]:
    out = []
    ref, host, fp8 = _tagged(data, "reference"), _tagged(data, "host-tier"), _tagged(data, "fp8")
    if fp8 is not None:
        f = _best(fp8, long)
        against = f" against {_b(_best(host, long))} with a RAM tier ({host.name})" if host else ""
        out.append(
            f"Quantize KV before offloading it: fp8 KV ({fp8.name}) reaches {_b(f)} at {long} tokens"
            f"{against}, with no transfers at all; check its quality on long-context tasks first."
        )
    if ref is not None and host is not None:
        out.append(
            f"A bounded RAM tier ({host.name}) reaches {_b(_best(host, long))} at {long} tokens against "
            f"{_b(_best(ref, long))} for the reference with enough VRAM ({ref.name}); size the RAM reserve "
            "from this p99, not from DIMM size."
        )
    return out
