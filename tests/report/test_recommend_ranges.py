"""Every kind of sentence in the recommendation claims a difference only where the
bootstrap ranges do not overlap, and says "no measurable difference" only where they do.

Boundaries at two contexts (so the sentences that compare contexts, not only variants,
are drawn) go in; each sentence is read for the order it states, and that order is
checked against the ranges written into the boundaries. The ranges are read here from the
boundary documents themselves (low: the confident pass, at most the point; high: one below
the confident miss, at least the point, open at the ladder's top), not through the code
under test.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tierguard.report.load import RunData, VariantData
from tierguard.report.recommend import advise
from tierguard.sweep.matrix import parse_matrix

SHORT, LONG = 256, 1024
TAGS = {
    "reference": ["reference"],
    "small-pool": ["no-tier"],
    "small-pool-host": ["host-tier"],
    "small-pool-host-nvme": ["disk-prefix"],
    "small-pool-fp8": ["fp8"],
    "naive-sync-disk": ["naive-sync-disk"],
}
BOUNDED = {"small-pool", "small-pool-host", "small-pool-host-nvme", "naive-sync-disk"}
TIERS = ("small-pool-host", "small-pool-host-nvme")


def boundary(ctx: int, best: int, low: int, high: int | None, ceiling: bool) -> dict:
    ceiling = ceiling and best > 0
    return {
        "context": ctx,
        "max_concurrency": best or None,
        "first_failing": None if ceiling else best + 1,
        "ceiling_reached": ceiling,
        "uncertainty": {"range": [low or None, None if ceiling else high]},
        "limited_by": [] if ceiling else ["ttft"],
    }


def span(b: dict) -> tuple[float, float]:
    """[low, high] of a boundary document, as its fields define them."""
    best = b["max_concurrency"] or 0
    lo, hi = b["uncertainty"]["range"]
    low = min(lo or 0, best)
    high = math.inf if hi is None or b["ceiling_reached"] else max(hi, best)
    return low, high


def run_data(drawn: dict[str, dict[int, dict]]) -> RunData:
    names = list(drawn)
    matrix = parse_matrix({
        "name": "t",
        "variants": [
            {"name": n, "base_url": "http://127.0.0.1:1", "tags": TAGS[n],
             "bounded_by": ["reference"] if n in BOUNDED and "reference" in names else []}
            for n in names
        ],
        "profile": {"context_lengths": [SHORT, LONG]},
        "slo": {"p99_ttft_ms": 2000, "p99_itl_ms": 100},
    })
    variants = [VariantData(n, "done", None, "", TAGS[n], {}, {}, b) for n, b in drawn.items()]
    return RunData(Path("."), matrix, variants, {}, {})


def contexts():
    one = st.integers(0, 16).flatmap(lambda best: st.tuples(
        st.just(best), st.integers(0, best), st.one_of(st.none(), st.integers(best, 20)), st.booleans()))
    return st.tuples(one, one)


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0]


def check(text: str, b: dict[str, dict[int, dict]]) -> None:
    """The order `text` states, against the ranges."""

    def apart(above: str, below: str, ctx: int = LONG, ctx_below: int | None = None) -> bool:
        return span(b[above][ctx])[0] > span(b[below][ctx_below or ctx])[1]

    def overlap(x: str, y: str, ctx: int = LONG) -> bool:
        return not apart(x, y, ctx) and not apart(y, x, ctx)

    if m := re.match(r"Long contexts leave the SLO first \(([\w-]+):", text):
        v = m.group(1)  # its long-context boundary measurably below its short-context one
        assert apart(v, v, SHORT, LONG), (text, b[v])
    elif "lowers the boundary at" in text:
        assert apart("small-pool-host-nvme", "naive-sync-disk"), text
    elif "measured above the contract" in text:
        assert apart("naive-sync-disk", "small-pool-host-nvme"), text
    elif "shows no measurable difference from the contract" in text:
        assert overlap("naive-sync-disk", "small-pool-host-nvme"), text
    elif text.startswith("Without reuse a tier costs here"):
        named = [t for t in TIERS if f"{t} " in _between(text, "the boundary is ", " against ")]
        assert named and all(apart("small-pool", t) for t in named), text
    elif "a tier costs no measurable boundary" in text:
        named = [t for t in TIERS if f"{t} " in _between(text, "boundary: ", " against ")]
        assert named and all(overlap("small-pool", t) for t in named), text
    elif "stays below a RAM tier" in text:
        assert apart("small-pool-host", "small-pool-fp8"), text
    elif text.startswith("Quantize KV before offloading it"):
        if "above a RAM tier" in text:
            assert apart("small-pool-fp8", "small-pool-host"), text
        else:
            assert "no measurable difference" in text and overlap("small-pool-fp8", "small-pool-host"), text
    elif text.startswith("fp8 KV") and "show no measurable difference" in text:
        assert overlap("small-pool-fp8", "small-pool-host"), text
    elif text.startswith("A bounded RAM tier"):
        if "no measurable difference from the reference" in text:
            assert overlap("small-pool-host", "reference"), text
        else:
            assert apart("reference", "small-pool-host"), text
    elif "which it cannot truly beat" in text:
        v, ctx = re.match(r"At (\d+) tokens ([\w-]+) measured", text).group(2, 1)
        if "their ranges overlap" in text:
            assert overlap(v, "reference", int(ctx)), text
        else:
            assert "beyond the ranges" in text and apart(v, "reference", int(ctx)), text


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(list(TAGS)), contexts(), min_size=2))
def test_every_sentence_claims_an_order_only_where_the_ranges_are_apart(drawn):
    b = {n: {SHORT: boundary(SHORT, *s), LONG: boundary(LONG, *lg)} for n, (s, lg) in drawn.items()}
    for advice in advise(run_data(b)):
        check(advice.text, b)


def test_long_contexts_overlapping_the_short_ones_claim_nothing():
    """The two-context sentence, by hand: points apart, ranges overlapping."""
    b = {n: {SHORT: boundary(SHORT, 8, 5, 11, False), LONG: boundary(LONG, 6, 4, 9, False)}
         for n in ("reference", "small-pool")}
    texts = [a.text for a in advise(run_data(b))]
    assert not any(t.startswith("Long contexts leave the SLO first") for t in texts)
    b["small-pool"][LONG] = boundary(LONG, 3, 2, 4, False)  # now measurably below its short range
    texts = [a.text for a in advise(run_data(b))]
    assert any(t.startswith("Long contexts leave the SLO first (small-pool:") for t in texts)
