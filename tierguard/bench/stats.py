"""Statistics over request records: the flat summary and the per-second time series.

Keys follow `vllm bench serve` (`mean_ttft_ms`, `median_…`, `std_…`, `p99_…`) so existing
dashboards read summary.json, plus `p90_`, `p95_`, `p999_` (99.9th), `max_` and ours;
percentiles by the one definition (common/percentile.py), the one vLLM's uses.
Distributions are over successful requests; failures, timeouts and rejections are
counted separately and count as SLO misses in goodput, never silently dropped.
"""

from __future__ import annotations

import math

import numpy as np

from tierguard.bench.config import SLO
from tierguard.bench.records import CANCELLED, OK, REJECTED, TIMEOUT, RequestRecord
from tierguard.common.percentile import percentile, percentiles

QUANTILES = (("median", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p999", 99.9))


def describe(values, name: str) -> dict[str, float | None]:
    """mean/std/median/p90/p95/p99/p999/max of `values` under vLLM-style key names."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    keys = ["mean", "std", *[q for q, _ in QUANTILES], "max"]
    if v.size == 0:
        return {f"{k}_{name}": None for k in keys}
    out = {f"mean_{name}": float(v.mean()), f"std_{name}": float(v.std())}
    pct = percentiles(v, [p for _, p in QUANTILES]) or []
    out.update({f"{q}_{name}": x for (q, _), x in zip(QUANTILES, pct, strict=True)})
    out[f"max_{name}"] = float(v.max())
    return out


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """A request meets the SLO when it succeeded and every set bound holds.

    ITL is judged on the request's worst per-token ITL (a stall counts, averaging would
    hide it)."""
    if not r.ok:
        return False
    checks = [(slo.ttft_ms, r.ttft_ms), (slo.tpot_ms, r.tpot_ms), (slo.e2el_ms, r.e2el_ms)]
    if slo.itl_ms is not None:
        itl = r.itl_samples_ms()
        checks.append((slo.itl_ms, float(itl.max()) if itl.size else 0.0))
    return all(bound is None or value is None or value <= bound for bound, value in checks)


def summarize(measured: list[RequestRecord], slo: SLO) -> dict:
    ok = [r for r in measured if r.ok]
    n_rej = sum(r.status == REJECTED for r in measured)
    n_to = sum(r.status == TIMEOUT for r in measured)
    n_cancel = sum(r.status == CANCELLED for r in measured)
    starts = [r.scheduled_s for r in measured]
    ends = [r.end_s for r in measured if r.end_s is not None]
    duration = (max(ends) - min(starts)) if ends and starts else 0.0
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    per = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    good = sum(meets_slo(r, slo) for r in measured)
    s: dict = {
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "rejected": n_rej,
        "timeouts": n_to,
        "cancelled": n_cancel,
        "num_prompts": len(measured),
        "duration": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": per(len(ok)),
        "output_throughput": per(out_tok),
        "total_token_throughput": per(in_tok + out_tok),
        "goodput": per(good) if slo.any() else None,
        "request_goodput": per(good) if slo.any() else None,
        "slo_attainment": good / len(measured) if slo.any() and measured else None,
    }
    itl = np.concatenate([r.itl_samples_ms() for r in ok]) if ok else np.empty(0)
    gaps = np.concatenate([r.chunk_gaps_ms() for r in ok]) if ok else np.empty(0)
    s.update(describe([r.ttft_ms for r in ok], "ttft_ms"))
    s.update(describe([r.tpot_ms for r in ok], "tpot_ms"))
    s.update(describe(itl, "itl_ms"))
    s.update(describe([r.e2el_ms for r in ok], "e2el_ms"))
    s.update(describe(gaps, "chunk_gap_ms"))
    s.update(describe([r.stall_ms for r in ok], "stall_ms"))
    s.update(describe([r.queue_wait_ms for r in measured], "queue_wait_ms"))
    s.update(describe([r.connect_ms for r in measured], "connect_ms"))
    s["connections_opened"] = sum(r.connect_ms is not None for r in measured)
    # TTFT with every failed request counted as infinitely late: a tail that includes failures.
    all_ttft = [r.ttft_ms if r.ok else math.inf for r in measured if r.status != CANCELLED]
    p = percentile(all_ttft, 99)
    s["p99_ttft_ms_incl_failed"] = p if p is not None and math.isfinite(p) else None
    sources = sorted({r.token_count_source for r in ok if r.token_count_source})
    s["token_count_source"] = ",".join(sources)
    groups = sorted({r.group.split("/")[0] for r in ok if r.group in ("long", "short")})
    for g in groups:  # mixed dataset: prefill side of long vs short separately
        s.update(describe([r.ttft_ms for r in ok if r.group == g], f"ttft_ms_{g}"))
    errors: dict[str, int] = {}
    for r in measured:
        if r.status != OK and r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    s["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])
    return s


def timeseries(records: list[RequestRecord], window_s: float = 10.0) -> list[dict]:
    """Per-second rows: completions, output tokens, in flight, sliding-window p99 TTFT/ITL."""
    ends = [r.end_s for r in records if r.end_s is not None]
    if not ends:
        return []
    horizon = int(math.ceil(max(ends)))
    tok_t = np.concatenate([np.asarray(r.chunk_times_s) for r in records] or [np.empty(0)])
    tok_k = np.concatenate([np.asarray(r.chunk_tokens, dtype=float) for r in records] or [np.empty(0)])
    first = np.asarray([r.first_token_s for r in records if r.ok and r.first_token_s is not None])
    ttft = np.asarray([r.ttft_ms for r in records if r.ok and r.first_token_s is not None])
    itl_t, itl_v = [], []
    for r in records:
        if r.ok and len(r.chunk_times_s) > 1:
            k = np.asarray(r.chunk_tokens[1:])
            itl_t.append(np.repeat(np.asarray(r.chunk_times_s[1:]), k))
            itl_v.append(r.itl_samples_ms())
    it = np.concatenate(itl_t) if itl_t else np.empty(0)
    iv = np.concatenate(itl_v) if itl_v else np.empty(0)
    sent = np.asarray([r.sent_s if r.sent_s is not None else math.inf for r in records])
    end = np.asarray([r.end_s if r.end_s is not None else math.inf for r in records])
    done = np.asarray([r.end_s if r.end_s is not None and r.ok else math.inf for r in records])
    fail = np.asarray([r.end_s if r.end_s is not None and not r.ok else math.inf for r in records])
    rows = []
    for sec in range(horizon):
        lo, hi = sec, sec + 1
        win = (first >= hi - window_s) & (first < hi)
        iwin = (it >= hi - window_s) & (it < hi)
        rows.append({
            "t": hi,
            "completed": int(((done >= lo) & (done < hi)).sum()),
            "failed": int(((fail >= lo) & (fail < hi)).sum()),
            "output_tokens": int(tok_k[(tok_t >= lo) & (tok_t < hi)].sum()),
            "in_flight": int(((sent < hi) & (end >= hi)).sum()),
            "p99_ttft_ms_window": percentile(ttft[win], 99),
            "p99_itl_ms_window": percentile(iv[iwin], 99),
        })
    return rows
