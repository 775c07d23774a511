"""Turn boundaries into decisions, in the article's terms (R14, R7, R4).

Rules read the boundary per context and the variants' tags (reference, host-tier,
disk-prefix, fp8, naive-sync-disk); each rule fires only when the numbers support it,
and every sentence quotes the numbers it rests on.
"""

from __future__ import annotations

from tierguard.report.load import RunData, VariantData


def _best(v: VariantData, ctx: int) -> int | None:
    return (v.boundaries.get(ctx) or {}).get("max_concurrency")


def _tagged(data: RunData, tag: str) -> list[VariantData]:
    return [v for v in data.variants if tag in v.tags and v.boundaries]


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
    for ctx in ctxs:
        values = [_best(v, ctx) for v in done]
        top = max((x for x in values if x is not None), default=None)
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
            f"At {ctx} tokens, {' and '.join(names)} hold{'s' if len(names) == 1 else ''} the SLOs up to "
            f"concurrency {bound}; admit no more than that per replica."
        )
    if len(ctxs) > 1:
        short, long = ctxs[0], ctxs[-1]
        for v in done:
            bs, bl = _best(v, short), _best(v, long)
            if bs is not None and (bl is None or bl < bs):
                out.append(
                    f"{v.name}: long contexts degrade first ({_b(bl)} at {long} vs {bs} at {short}) - "
                    f"give long sessions a separate pool or their own lower concurrency limit "
                    f"instead of one max_model_len for everyone."
                )
                break
    out += _pairwise(data, ctxs)
    return out


def _pairwise(data: RunData, ctxs: list[int]) -> list[str]:
    out: list[str] = []
    long = ctxs[-1]

    def cmp(a: VariantData, b: VariantData) -> tuple[int | None, int | None]:
        return _best(a, long), _best(b, long)

    naive, disk = _tagged(data, "naive-sync-disk"), _tagged(data, "disk-prefix")
    if naive and disk:
        n, d = cmp(naive[0], disk[0])
        if (n or 0) < (d or 0):
            out.append(
                f"Reading NVMe synchronously in the decode loop ({naive[0].name}) lowers the boundary at "
                f"{long} tokens from {_b(d)} to {_b(n)}: keep NVMe only as a prefix cache that is "
                f"loaded before the answer starts ({disk[0].name})."
            )
    ref, host = _tagged(data, "reference"), _tagged(data, "host-tier")
    if ref and host:
        r, h = cmp(ref[0], host[0])
        out.append(
            f"A bounded RAM tier ({host[0].name}) reaches {_b(h)} at {long} tokens against {_b(r)} for "
            f"the reference with enough VRAM ({ref[0].name}); size the RAM reserve from this p99, not "
            f"from DIMM size."
        )
    fp8 = _tagged(data, "fp8")
    if fp8 and ref:
        f, r = cmp(fp8[0], ref[0])
        out.append(
            f"fp8 KV ({fp8[0].name}) moves the boundary at {long} tokens to {_b(f)} (reference {_b(r)}); "
            "check its quality on long-context tasks before relying on it."
        )
    return out
