"""The recommendation follows the measured boundaries and their ranges.

Boundary sets of each kind (better, worse, overlapping, an impossible order) go in; the
sentences that come out are checked, and a property test checks that no sentence calls
A better than B, or recommends A before B, while A's measured boundary is below B's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierguard.report.compare import Measured, relation
from tierguard.report.load import RunData, VariantData
from tierguard.report.recommend import advise, recommendations
from tierguard.sweep.matrix import parse_matrix

CTX = 1024
TAGS = {
    "reference": ["reference"],
    "small-pool": ["no-tier"],
    "small-pool-host": ["host-tier"],
    "small-pool-host-nvme": ["disk-prefix"],
    "small-pool-fp8": ["fp8"],
    "naive-sync-disk": ["naive-sync-disk"],
}
BOUNDED = {"small-pool", "small-pool-host", "small-pool-host-nvme", "naive-sync-disk"}


def _boundary(best: int, low: int | None = None, high: int | None = None, ceiling: bool = False) -> dict:
    """A boundary as sweep writes it: `low`/`high` default to a tight range at `best`."""
    low = best if low is None else low
    high = None if ceiling else (best if high is None else high)
    return {
        "context": CTX,
        "max_concurrency": best or None,
        "first_failing": None if ceiling else best + 1,
        "ceiling_reached": ceiling,
        "uncertainty": {"range": [low or None, high]},
        "limited_by": [] if ceiling else ["ttft"],
    }


def _run(boundaries: dict[str, dict]) -> RunData:
    names = list(boundaries)
    matrix = parse_matrix({
        "name": "t",
        "variants": [
            {
                "name": n,
                "base_url": "http://127.0.0.1:1",
                "tags": TAGS[n],
                "bounded_by": ["reference"] if n in BOUNDED and "reference" in names else [],
            }
            for n in names
        ],
        "profile": {"context_lengths": [CTX]},
        "slo": {"p99_ttft_ms": 2000, "p99_itl_ms": 100},
    })
    variants = [
        VariantData(n, "done", None, "", TAGS[n], {}, {}, {CTX: b}) for n, b in boundaries.items()
    ]
    return RunData(Path("."), matrix, variants, {}, {})


def _text(boundaries: dict[str, dict]) -> str:
    return "\n".join(recommendations(_run(boundaries)))


def test_relation_needs_ranges_apart():
    a = Measured("a", 10, 9, 11, False)
    assert relation(a, Measured("b", 6, 5, 7, False)) == "above"
    assert relation(a, Measured("b", 8, 7, 9, False)) == "same"  # ranges touch at 9
    assert relation(Measured("b", 6, 5, 7, False), a) == "below"
    assert relation(a, Measured("c", 4, 4, float("inf"), True)) == "same"  # open above


def test_fp8_below_a_ram_tier_says_what_was_measured():
    text = _text({"small-pool-host": _boundary(10, 9, 11), "small-pool-fp8": _boundary(8, 7, 8)})
    assert "Quantize KV before offloading" not in text
    assert "stays below a RAM tier" in text and "default to test, not a result" in text


def test_fp8_above_a_ram_tier_is_recommended_first():
    text = _text({"small-pool-host": _boundary(6, 5, 6), "small-pool-fp8": _boundary(9, 8, 10)})
    assert "Quantize KV before offloading it: fp8 KV (small-pool-fp8) reaches 9 [8, 10]" in text
    assert "above a RAM tier" in text


def test_fp8_and_a_ram_tier_overlapping_are_not_separated():
    text = _text({"small-pool-host": _boundary(10, 7, 12), "small-pool-fp8": _boundary(8, 6, 11)})
    assert "no measurable difference" in text and "Quantize KV before" not in text


def test_a_tier_that_costs_nothing_measurable_is_said_so():
    text = _text({
        "small-pool": _boundary(15, 12, 16),
        "small-pool-host": _boundary(13, 11, 15),
        "small-pool-host-nvme": _boundary(6, 5, 7),
    })
    assert "a tier costs no measurable boundary: small-pool-host 13 [11, 15]" in text
    assert "Without reuse a tier costs here: on unique prompts at 1024 tokens the boundary is " \
        "small-pool-host-nvme 6 [5, 7]" in text
    assert "small-pool-host 13" not in text.split("Without reuse")[1].split("\n")[0]


def test_small_pool_above_the_reference_is_noise():
    text = _text({"reference": _boundary(13, 11, 14), "small-pool": _boundary(15, 12, 16)})
    assert ("small-pool measured 15 [12, 16] against 13 [11, 14] for reference, which it cannot truly "
            "beat") in text
    assert "the difference is noise: their ranges overlap" in text


def test_small_pool_above_the_reference_beyond_the_ranges_asks_for_repeats():
    text = _text({"reference": _boundary(8, 8, 8), "small-pool": _boundary(15, 14, 16)})
    assert "noise beyond the ranges" in text and "uncertainty.repeats" in text


def test_reference_above_the_small_pool_is_not_noise():
    text = _text({"reference": _boundary(16, ceiling=True), "small-pool": _boundary(9)})
    assert "cannot truly beat" not in text


def test_naive_overlapping_the_contract_claims_nothing():
    text = _text({"small-pool-host-nvme": _boundary(4, 3, 6), "naive-sync-disk": _boundary(3, 2, 5)})
    assert "lowers the boundary" not in text and "no measurable difference from the contract" in text


def test_naive_below_the_contract_is_the_failure_mode():
    text = _text({"small-pool-host-nvme": _boundary(9, 8, 11), "naive-sync-disk": _boundary(2, 2, 3)})
    assert "lowers the boundary at 1024 tokens from 9 [8, 11] to 2 [2, 3]" in text


@pytest.mark.parametrize("ceiling", [False, True])
def test_every_sentence_quotes_ranges_it_compares(ceiling):
    text = _text({
        "reference": _boundary(16, 12, None, ceiling=ceiling),
        "small-pool": _boundary(9, 8, 10),
        "small-pool-host": _boundary(8, 7, 9),
    })
    assert "8 [7, 9]" in text and "9 [8, 10]" in text


def _boundaries():
    def one(draw_best, draw_lo, draw_hi, draw_ceiling):
        return draw_best, draw_lo, draw_hi, draw_ceiling

    point = st.integers(0, 16).flatmap(
        lambda best: st.tuples(
            st.just(best),
            st.integers(0, best),
            st.one_of(st.none(), st.integers(best, 20)),
            st.booleans(),
        )
    )
    return st.dictionaries(st.sampled_from(list(TAGS)), point, min_size=2)


@settings(max_examples=300, deadline=None)
@given(_boundaries())
def test_no_claim_contradicts_the_measured_order(drawn):
    boundaries = {
        n: _boundary(best, lo, hi, ceiling=ceiling and best > 0) for n, (best, lo, hi, ceiling) in drawn.items()
    }
    data = _run(boundaries)
    best = {n: b["max_concurrency"] or 0 for n, b in boundaries.items()}
    for advice in advise(data):
        for claim in advice.claims:
            assert best[claim.a] >= best[claim.b], (advice.text, claim)
            if claim.kind == "better":
                assert best[claim.a] > best[claim.b], (advice.text, claim)
        text = advice.text
        if "Quantize KV before offloading" in text:
            assert best["small-pool-fp8"] >= best.get("small-pool-host", 0)
