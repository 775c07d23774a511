"""One percentile definition behind every figure tierguard prints (common/percentile.py).

The definition is numpy's linear one, which `vllm bench serve` reports; the same samples
given to every module that prints a p99 must give the same number, and no other
percentile implementation may exist in the package or the bench scripts.
"""

from __future__ import annotations

import math
import re
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from tierguard.bench import progress, selfcheck
from tierguard.bench.config import SLO
from tierguard.bench.records import OK, RequestRecord
from tierguard.bench.stats import describe, summarize
from tierguard.common.percentile import percentile, percentiles
from tierguard.common.stats import quantile_ms
from tierguard.sweep.stats import RequestSample, p99_with_interval, quantile

ROOT = Path(__file__).resolve().parents[2]


def test_the_definition_is_vllm_bench_serves():
    v = list(range(100, 0, -1))  # 1 .. 100, in any order
    assert (percentile(v, 50), percentile(v, 99), percentile(v, 100), percentile(v, 0)) == (50.5, 99.01, 100.0, 1.0)
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 101, 1000):
        x = rng.exponential(size=n)
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert percentile(x, q) == pytest.approx(float(np.percentile(x, q)), rel=1e-12, abs=1e-12)
    assert percentiles(v, [50, 99]) == [50.5, 99.01]
    assert v[0] == 100  # the input is not sorted in place


def test_inf_is_a_value_empty_is_named_and_nonsense_is_refused():
    assert percentile([1.0, math.inf], 99) == math.inf  # numpy gives NaN here
    assert percentile([1.0, math.inf], 0) == 1.0
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    assert percentile([], 99) is None and percentile([], 99, empty=0.0) == 0.0 and percentiles([], [99]) is None
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)


def _records(ttft_ms: list[float]) -> list[RequestRecord]:
    out = []
    for i, t in enumerate(ttft_ms):
        first = t / 1000
        chunks = [first + 0.01 * k for k in range(4)]
        out.append(RequestRecord(index=i, scheduled_s=0.0, sent_s=0.0, first_token_s=first, end_s=chunks[-1],
                                 chunk_times_s=chunks, chunk_tokens=[1] * 4, output_tokens=4, status=OK))
    return out


def test_every_module_that_prints_a_p99_gives_the_same_number():
    rng = np.random.default_rng(3)
    ms = [round(float(x), 3) for x in rng.lognormal(4.0, 0.6, size=137)]
    want = float(np.percentile(ms, 99))
    got = {
        "common.percentile": percentile(ms, 99),
        "common.stats.quantile_ms (serve's tier metrics)": quantile_ms([x / 1000 for x in ms], 0.99),
        "sweep.stats.quantile": quantile(np.asarray(ms), 0.99),
        "sweep p99 (boundaries, report, predict)": p99_with_interval(
            [RequestSample(ok=True, ttft_ms=x) for x in ms], "ttft", 0, 0.9).value,
        "bench describe": describe(ms, "x")["p99_x"],
        "bench summary.json": summarize(_records(ms), SLO())["p99_ttft_ms"],
        "bench summary.json, failures included": summarize(_records(ms), SLO())["p99_ttft_ms_incl_failed"],
        "bench progress": float(progress._p99(deque(ms))),
        "bench self-check": selfcheck.assess([], ms, 1, 1e9, 1e9, 1.0)["p99_send_lateness_ms"],
    }
    for where, value in got.items():
        assert value == pytest.approx(want, abs=0.051 if where == "bench progress" else 1e-6), where


CALLS = re.compile(r"\b(?:np|numpy)\.(?:nan)?(?:percentile|quantile)\(|statistics\.quantiles\(|method=\"(?:inverted_cdf|higher|lower|nearest)\"")


def test_no_other_percentile_implementation_exists():
    hits = []
    for base in ("tierguard", "bench"):
        for f in sorted((ROOT / base).rglob("*.py")):
            if f == ROOT / "tierguard" / "common" / "percentile.py":
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if CALLS.search(line) or re.search(r"\[min\(len\(\w+\) - 1, int\(", line):
                    hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "percentiles outside common/percentile.py:\n" + "\n".join(hits)
