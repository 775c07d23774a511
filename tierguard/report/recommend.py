"""Turn boundaries into decisions, in the article's terms (R14, R7, R4, R5; see
docs/requirements.md).

Rules read the boundary per context, the prefix-reuse slice and the variants' tags
(reference, no-tier, host-tier, disk-prefix, fp8, naive-sync-disk). Every sentence
quotes the numbers it rests on, and every comparison follows the measured order with
its uncertainty (compare.py):
  - two boundaries whose ranges overlap are "no measurable difference", whatever their
    points say;
  - where the measured order contradicts R7's remedy order, the sentence says what was
    measured and that R7's order is a default to test, not a result;
  - a variant measured above one it cannot truly beat (`bounded_by` in the matrix: less
    memory, otherwise the same settings) is reported as noise, with both ranges.
The order follows the article: admission limits first, then long sessions, what NVMe is
for, prefix reuse, the cost of a tier, KV quantization before offload, the RAM tier last.
"""

from __future__ import annotations

from tierguard.report.compare import Advice, Claim, Measured, relation
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
    return [a.text for a in advise(data)]


def advise(data: RunData) -> list[Advice]:
    """The recommendation's sentences, each with the comparisons it makes."""
    ctxs = sorted(data.matrix.profile.context_lengths)
    done = [v for v in data.variants if v.boundaries]
    out: list[Advice] = []
    for v in data.variants:
        if v.status == "failed":
            out.append(Advice(f"{v.name} did not run ({v.error}); it has no boundary."))
    if not done:
        return out
    out += _limits(done, ctxs)
    out += _noise(data, ctxs)
    out += _long_sessions(data, done, ctxs)
    out += _nvme(data, ctxs[-1])
    out += _prefix(data)
    out += _tier_cost(data, ctxs[-1])
    out += _quantize_and_ram(data, ctxs[-1])
    return out


def _limits(done: list[VariantData], ctxs: list[int]) -> list[Advice]:
    out = []
    for ctx in ctxs:
        top = max((x for x in (_best(v, ctx) for v in done) if x is not None), default=None)
        if top is None:
            out.append(Advice(
                f"At {ctx} tokens no variant meets the SLOs even alone: lower the maximum context "
                "or move such requests to an asynchronous mode."
            ))
            continue
        names = [v.name for v in done if _best(v, ctx) == top]
        ceiling = all((v.boundaries.get(ctx) or {}).get("ceiling_reached") for v in done if v.name in names)
        bound = f"at least {top} (the ladder's top)" if ceiling else str(top)
        out.append(Advice(
            f"At {ctx} tokens, {', '.join(names)} hold{'s' if len(names) == 1 else ''} the SLOs up to "
            f"concurrency {bound}; admit no more than that per replica (a bounded queue, not an open one)."
        ))
    return out


def _noise(data: RunData, ctxs: list[int]) -> list[Advice]:
    """A variant measured above one it cannot truly beat: the difference is noise."""
    by_name = {v.name: v for v in data.variants}
    out = []
    for spec in data.matrix.variants:
        v = by_name.get(spec.name)
        for bound_name in spec.bounded_by:
            w = by_name.get(bound_name)
            if v is None or w is None:
                continue
            for ctx in ctxs:
                a, b = Measured.of(v, ctx), Measured.of(w, ctx)
                if a is None or b is None or a.best <= b.best:
                    continue
                if relation(a, b) == "same":
                    why = "the difference is noise: their ranges overlap"
                else:
                    why = ("the difference is noise beyond the ranges the bootstrap gives; "
                           "repeat the cells (uncertainty.repeats) before acting on either")
                out.append(Advice(
                    f"At {ctx} tokens {v.name} measured {a.interval()} against {b.interval()} for "
                    f"{w.name}, which it cannot truly beat (less memory, otherwise the same settings): "
                    f"{why}. Read both as {w.name}'s range."
                ))
    return out


def _long_sessions(data: RunData, done: list[VariantData], ctxs: list[int]) -> list[Advice]:
    if len(ctxs) < 2:
        return []
    short, long = ctxs[0], ctxs[-1]
    first = _tagged(data, "reference")
    for v in ([first] if first else []) + done:
        ms, ml = Measured.of(v, short), Measured.of(v, long)
        if ms is None:
            continue
        if ml is None or relation(ml, ms) == "below":
            return [Advice(
                f"Long contexts leave the SLO first ({v.name}: {_b(_best(v, long))} at {long} tokens vs "
                f"{ms.best} at {short}): give long sessions a separate pool, or their own lower "
                "concurrency limit, instead of one max_model_len for everyone."
            )]
    return []


def _first_miss(v: VariantData, ctx: int) -> CellVerdict | None:
    first = (v.boundaries.get(ctx) or {}).get("first_failing")
    return v.cells.get(CellSpec("ladder", ctx, first).key) if first is not None else None


def _nvme(data: RunData, long: int) -> list[Advice]:
    naive, disk = _tagged(data, "naive-sync-disk"), _tagged(data, "disk-prefix")
    if naive is None or disk is None:
        return []
    n, d = Measured.of(naive, long), Measured.of(disk, long)
    if n is None or d is None:
        return []
    rel = relation(n, d)
    if rel == "above":
        return [Advice(
            f"Reading NVMe inside the decode loop ({naive.name}) measured above the contract at {long} "
            f"tokens ({n.interval()} vs {d.interval()} for {disk.name}); its reads may be served from the "
            "page cache, so this run does not show the failure mode."
        )]
    if rel == "same":
        return [Advice(
            f"Reading NVMe inside the decode loop ({naive.name}) shows no measurable difference from the "
            f"contract at {long} tokens ({n.interval()} vs {d.interval()} for {disk.name}); its reads may "
            "be served from the page cache."
        )]
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
    return [Advice(
        f"Reading NVMe synchronously in the decode loop ({naive.name}) lowers the boundary at {long} tokens "
        f"from {d.interval()} to {n.interval()}{detail}: use NVMe only as a prefix cache and a cold tier "
        f"loaded before the answer starts ({disk.name}), never as an extension of VRAM.",
        (Claim("better", disk.name, naive.name, long),),
    )]


def _prefix_cell(v: VariantData) -> CellVerdict | None:
    cells = sorted((c for c in v.cells.values() if c.slice == "prefix"), key=lambda c: c.concurrency)
    return cells[0] if cells else None


def _prefix(data: RunData) -> list[Advice]:
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
            out.append(Advice(
                f"Repeated prefixes: {v.name} turns recompute into loads - p50 TTFT {fmt_ms(p)} ms against "
                f"{fmt_ms(pb)} ms for {bare.name}, which recomputes evicted prefixes{tail}."
            ))
        else:
            out.append(Advice(
                f"Repeated prefixes: {v.name} did not beat recompute (p50 TTFT {fmt_ms(p)} vs "
                f"{fmt_ms(pb)} ms for {bare.name}); on this machine loading a prefix costs as much as "
                "computing it, so a prefix tier is not worth its budget."
            ))
    return out


def _tier_cost(data: RunData, long: int) -> list[Advice]:
    """What a tier costs on unique prompts, where nothing is reused: measurably less,
    or no measurable difference."""
    bare = next((v for v in data.variants if "no-tier" in v.tags and v.boundaries), None)
    mb = Measured.of(bare, long) if bare is not None else None
    if bare is None or mb is None:
        return []
    lower, same = [], []
    for v in data.variants:
        m = Measured.of(v, long) if {"host-tier", "disk-prefix"} & set(v.tags) else None
        if m is None:
            continue
        rel = relation(m, mb)
        if rel == "below":
            lower.append(m)
        elif rel == "same":
            same.append(m)
    out = []
    if lower:
        names = ", ".join(f"{m.name} {m.interval()}" for m in lower)
        out.append(Advice(
            f"Without reuse a tier costs here: on unique prompts at {long} tokens the boundary is {names} "
            f"against {mb.interval()} for {bare.name}. Enable a tier for traffic that repeats prefixes or "
            "resumes sessions, not by default.",
            tuple(Claim("better", bare.name, m.name, long) for m in lower),
        ))
    if same:
        names = ", ".join(f"{m.name} {m.interval()}" for m in same)
        out.append(Advice(
            f"On unique prompts at {long} tokens a tier costs no measurable boundary: {names} against "
            f"{mb.interval()} for {bare.name} (the ranges overlap)."
        ))
    return out


def _quantize_and_ram(data: RunData, long: int) -> list[Advice]:
    out = []
    ref, host, fp8 = _tagged(data, "reference"), _tagged(data, "host-tier"), _tagged(data, "fp8")
    mf = Measured.of(fp8, long) if fp8 is not None else None
    mh = Measured.of(host, long) if host is not None else None
    if fp8 is not None and mf is not None:
        rel = relation(mf, mh) if mh is not None else None
        if host is None or mh is None:
            out.append(Advice(
                f"fp8 KV ({fp8.name}) reaches {mf.interval()} at {long} tokens with no transfers at all; "
                "check its quality on long-context tasks (tierguard kvcheck) before relying on it."
            ))
        elif rel == "below":
            out.append(Advice(
                f"Measured, fp8 KV ({fp8.name}, {mf.interval()}) stays below a RAM tier ({host.name}, "
                f"{mh.interval()}) at {long} tokens. R7 puts KV quantization before RAM offload, but that "
                "order is a default to test, not a result: on this workload the RAM tier held more."
            ))
        elif rel == "same" and mf.best < mh.best:
            out.append(Advice(
                f"fp8 KV ({fp8.name}, {mf.interval()}) and a RAM tier ({host.name}, {mh.interval()}) show "
                f"no measurable difference at {long} tokens. R7 puts KV quantization first because it needs "
                "no transfers; this run does not separate them, so that order stays a default to test."
            ))
        else:
            how = "above" if rel == "above" else "as far as (no measurable difference from)"
            out.append(Advice(
                f"Quantize KV before offloading it: fp8 KV ({fp8.name}) reaches {mf.interval()} at {long} "
                f"tokens, {how} a RAM tier ({host.name}, {mh.interval()}), with no transfers at all; check "
                "its quality on long-context tasks first.",
                (Claim("before", fp8.name, host.name, long),),
            ))
    mr = Measured.of(ref, long) if ref is not None else None
    if ref is not None and host is not None and mr is not None and mh is not None:
        if relation(mh, mr) == "below":
            how = f"{mh.interval()} at {long} tokens against {mr.interval()} for the reference"
        else:
            how = (f"{mh.interval()} at {long} tokens, no measurable difference from the reference's "
                   f"{mr.interval()}")
        out.append(Advice(
            f"A bounded RAM tier ({host.name}) reaches {how} with enough VRAM ({ref.name}); size the RAM "
            "reserve from this p99, not from DIMM size."
        ))
    return out
