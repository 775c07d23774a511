from __future__ import annotations

import logging

import pytest

from tierguard.common.errors import TierguardError
from tierguard.common.stats import flat
from tierguard.kv.contract import BATCH, INTERACTIVE, ColdContract, classify_request, parse_ttft_budgets


def test_parse_budgets():
    assert parse_ttft_budgets("800")[INTERACTIVE] == 800.0
    b = parse_ttft_budgets("interactive=250, batch=60000")
    assert b == {INTERACTIVE: 250.0, BATCH: 60000.0}
    for bad in ("fast=10", "interactive=abc", "batch=-1", "0"):
        with pytest.raises(TierguardError):
            parse_ttft_budgets(bad)


def test_classify_request():
    assert classify_request({}) == INTERACTIVE
    assert classify_request({"service_tier": "flex"}) == BATCH
    assert classify_request({"priority": 5}) == BATCH
    assert classify_request({"priority": 0}) == INTERACTIVE
    assert classify_request({"priority": "batch"}) == BATCH
    assert classify_request({"service_tier": "batch"}, {"X-Tierguard-Class": "interactive"}) == INTERACTIVE
    # the one request-class header, as the gate reads it; X-Tierguard-Class stays an alias
    assert classify_request({}, {"x-tierguard-priority": "batch"}) == BATCH
    assert classify_request({"service_tier": "nonsense"}) == INTERACTIVE


def test_staging_deadline_is_a_share_of_the_class_budget():
    c = ColdContract({INTERACTIVE: 400.0, BATCH: 10000.0}, staging_share=0.25)
    assert c.staging_deadline(INTERACTIVE, 100.0) == pytest.approx(100.1)
    assert c.staging_deadline(BATCH, 100.0) == pytest.approx(102.5)
    with pytest.raises(ValueError):
        c.staging_deadline("vip", 0.0)


def test_decisions_are_per_class_and_counted(caplog):
    c = ColdContract({INTERACTIVE: 500.0})
    with caplog.at_level(logging.INFO, logger="tierguard.kv.contract"):
        assert c.decide_on_miss(INTERACTIVE, staged_in_time=True).action == "wait"
        d = c.decide_on_miss(INTERACTIVE, staged_in_time=False)
        assert d.action == "recompute" and "deadline" in d.reason
        assert c.decide_on_miss(BATCH, staged_in_time=False).action == "wait"
        # recompute hopeless and the request may go async -> async; without permission -> recompute
        assert c.decide_on_miss(INTERACTIVE, False, recompute_ms=10_000, allow_async=True).action == "async"
        assert c.decide_on_miss(INTERACTIVE, False, recompute_ms=10_000).action == "recompute"
        assert c.decide_on_miss(INTERACTIVE, False, recompute_ms=100, allow_async=True).action == "recompute"
    s = flat(c.stats(), prefix="kv_")
    assert s["kv_contract_interactive_recompute"] == 3 and s["kv_contract_interactive_async"] == 1
    assert s["kv_contract_batch_wait"] == 1 and s["kv_contract_interactive_wait"] == 1
    assert s["kv_staging_deadline_misses_interactive"] == 4 and s["kv_staging_deadline_misses_batch"] == 1
    assert sum("cold contract" in r.message for r in caplog.records) == 6


def test_class_order_rules():
    c = ColdContract({INTERACTIVE: 500.0, BATCH: 2000.0})
    assert c.goes_first("interactive") and c.goes_first("realtime") and not c.goes_first("flex")
    assert c.yields_room(BATCH) and not c.yields_room(INTERACTIVE)
    assert not c.overdue(BATCH, queued_at=10.0, now=11.9) and c.overdue(BATCH, queued_at=10.0, now=12.1)
    assert c.overdue("interactive", queued_at=10.0, now=10.6)
