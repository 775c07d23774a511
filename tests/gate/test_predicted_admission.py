"""Predicted-TTFT admission as a policy: the closed form, its fit, its decisions and order.

The controller runs here on a pinned clock with known costs (online fit off unless the
test is about the fit), so every prediction is exact arithmetic: a request's predicted
TTFT is the work ahead of it plus its own at 10 ms a token. The gate in front of a real
upstream is tests/gate/test_predicted_gate.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from tierguard.common.errors import TierguardError
from tierguard.gate.admission import Rejected, RequestInfo
from tierguard.gate.policy import AdmissionPolicy
from tierguard.gate.ttft_admission import PredictedAdmission
from tierguard.gate.ttft_model import TERMS, OnlineFit, Prior, features, keys_of, load_calibration
from tierguard.gate.ttft_options import PredictedOptions, calibration_files, parse_slo_ms

PER_TOKEN = 0.01  # seconds: 100 tokens = 1 s
CHUNK = 100


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def controller(clock: Clock, interactive_ms: float = 5000, batch_ms: float = 20000, shared=None,
               **policy) -> PredictedAdmission:
    prior = Prior([0.0, PER_TOKEN, 0.0, 0.0, 0.0], CHUNK, rel_sd=0.05, source="test", weight=8.0)
    opts = PredictedOptions({"interactive": interactive_ms / 1000, "batch": batch_ms / 1000}, [prior], online=False)
    return PredictedAdmission(AdmissionPolicy(**policy), opts, ["http://upstream"], clock=clock, shared=shared)


def info(tokens: int, priority: str = "interactive", key: str | None = None) -> RequestInfo:
    return RequestInfo(input_tokens=tokens, priority=priority, key=key)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def sent_order(c: PredictedAdmission) -> list[int]:
    u = c.upstreams[0]
    return [s.tokens for s in (*u.decoding.values(), *u.prefilling.values())]


def test_the_fit_converges_to_a_known_cost_and_follows_it_when_it_changes():
    truth = [0.012, 0.0002, 0.0, 0.004, 0.0008]  # per_key comes from calibrations only
    fit = OnlineFit(Prior.empty(512))
    rng = random.Random(1)

    def draw(cost):
        prompts = [rng.choice([64, 256, 2048]) for _ in range(rng.randint(1, 6))]
        x = features(sum(prompts), sum(keys_of(p) for p in prompts), rng.randint(0, 12), 512)
        return x, sum(a * b for a, b in zip(cost, x, strict=True)) * (1 + rng.gauss(0, 0.02))

    def errors(cost):  # (median, worst) relative error on shapes it has not seen
        held_out = [draw(cost)[0] for _ in range(100)]
        exact = [(x, sum(a * b for a, b in zip(cost, x, strict=True))) for x in held_out]
        e = sorted(abs(fit.predict(x) - y) / y for x, y in exact)
        return e[50], e[-1]

    assert errors(truth)[0] > 0.9  # knowing nothing, it predicts nothing
    for _ in range(300):
        fit.observe(*draw(truth))
    median, worst = errors(truth)
    assert median < 0.02 and worst < 0.15
    assert fit.rel_sd < 0.1  # and it knows how good it is
    assert all(c >= 0 for c in fit.coef) and len(fit.coef_sd()) == len(TERMS)
    doubled = [2 * c for c in truth]  # the load mix or the machine changed: it forgets and follows
    for _ in range(400):
        fit.observe(*draw(doubled))
    median, worst = errors(doubled)
    assert median < 0.05 and worst < 0.25


def test_a_frozen_fit_keeps_a_wrong_prior_and_says_how_wrong_it_is():
    truth = [0.01, 0.0002, 0.0, 0.002, 0.0005]
    fit = OnlineFit(Prior([c / 2 for c in truth], 512, rel_sd=0.05, source="half.json", weight=8.0), learn=False)
    for n in (128, 512, 1024) * 10:
        x = features(n, keys_of(n), 0, 512)
        fit.observe(x, sum(a * b for a, b in zip(truth, x, strict=True)))
    assert fit.coef == pytest.approx([c / 2 for c in truth])  # kept as told ...
    assert 0.6 < fit.rel_bias <= 2 / 3  # ... measured = 2 x predicted: (2 - 1) / 1.5, the first answers clipped
    assert fit.rel_sd > 0.5 and fit.observations == 30  # and the spread admission uses grows with it


def test_calibration_files_of_both_kinds_load_and_bad_ones_are_named(tmp_path):
    from tierguard.predict.calibrate import Calibration, ProbePlan
    from tierguard.predict.costmodel import REGIME_FEATURES, Linear, StepCost
    from tierguard.predict.driver import ClientTiming
    from tierguard.predict.engines import Policy

    plan = ProbePlan([128, 512, 1024], 512, [2, 4], 16)
    ours = StepCost({"decode": Linear(REGIME_FEATURES["decode"], [0.002, 0.0001, 1e-7]),
                     "wide": Linear(REGIME_FEATURES["wide"], [0.003, 0.0002, 4e-8, 0.0001, 0.0005])},
                    fused_max_rows=64, gap=Linear(("1", "sampled"), [0.0004, 0.00002]))
    path = tmp_path / "ours.json"
    path.write_text(json.dumps(Calibration("tierguard", "f1", ours, ClientTiming(0.001, 0.002, [], 0.003),
                                           plan, 0.1).to_json()))
    p = load_calibration(str(path))
    assert p.chunk == 1024 and p.rel_sd == 0.1 and p.source == "ours.json"
    assert p.coef == pytest.approx([0.004, 0.0002, 4e-8, 0.003 + 0.0005 + 0.0004,
                                    0.0002 + 4e-8 * 512 + 0.0001 + 0.00002])
    generic = StepCost({"decode": Linear(REGIME_FEATURES["decode"], [0.01, 0.001, 0.0]),
                        "chunk": Linear(REGIME_FEATURES["chunk"], [0.01, 0.001, 0.0, 0.02, 0.0003, 1e-8])},
                       generic=True)
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(Calibration("generic", "f2", generic, ClientTiming(0.005, 0.0), plan, 0.2,
                                           Policy(max_num_batched_tokens=2048)).to_json()))
    p = load_calibration(str(path))
    assert p.chunk == 2048 and p.coef == pytest.approx([0.005, 0.0003, 1e-8, 0.03, 0.001])
    assert load_calibration(str(path), chunk=256).chunk == 256
    for text, words in (("not json", "not a JSON file"), ('{"kind": "x"}', "not a tierguard predict calibration"),
                        ('{"kind": "generic", "cost": {"regimes": {}}}', "'chunk' is missing")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(TierguardError, match=words):
            load_calibration(str(tmp_path / "bad.json"))
    with pytest.raises(TierguardError, match="cannot read"):
        load_calibration(str(tmp_path / "missing.json"))


def test_options_are_checked_with_messages_that_name_them():
    assert parse_slo_ms("interactive=800") == {"interactive": 800.0, "batch": 20000.0}
    assert parse_slo_ms({"batch": 5000}) == {"interactive": 1000.0, "batch": 5000.0}
    for bad, words in (("fast=10", "unknown class"), ("interactive", "expected CLASS=MS"),
                       ("interactive=-1", "positive"), ("batch=soon", "not a number")):
        with pytest.raises(TierguardError, match=words):
            parse_slo_ms(bad)
    urls = ["http://a:1", "http://b:2"]
    assert calibration_files(["all.json", "1=b.json"], urls) == ["all.json", "b.json"]
    assert calibration_files(["http://a:1/v1=a.json"], urls) == ["a.json", None]
    with pytest.raises(TierguardError, match="no upstream 2"):
        calibration_files(["2=x.json"], urls)
    with pytest.raises(TierguardError, match="not one of the --upstream"):
        calibration_files(["http://c:3=x.json"], urls)
    from tierguard.gate.policy import build_settings

    ok = build_settings({"upstream": "http://a:1", "admission": "predicted", "ttft_online": "off"})
    assert ok.admission == "predicted"
    for bad, words in (({"admission": "guess"}, "--admission must be one of static, predicted"),
                       ({"admission": "predicted", "ttft_calibration": ["/nonexistent.json"]}, "cannot read it"),
                       ({"admission": "predicted", "ttft_online": "maybe"}, "--ttft-online must be on or off"),
                       ({"admission": "predicted", "ttft_chunk_tokens": 0}, "--ttft-chunk-tokens")):
        with pytest.raises(TierguardError, match=words):
            build_settings({"upstream": "http://a:1", **bad})


def test_over_the_slo_is_429_with_retry_after_the_predicted_wait():
    async def go():
        clock = Clock()
        c = controller(clock)
        a = await c.acquire(info(200))  # sent at once: 2 s of prefill
        b = asyncio.ensure_future(c.acquire(info(200)))  # 2 s behind a: 4 s, admitted, waits in the gate
        await settle()
        assert not b.done() and c.stats().queued["interactive"] == 1
        with pytest.raises(Rejected) as r:  # 4 s ahead + 1 s of its own: 5 s x (1 + 2 x 5 %) > 5 s
            await c.acquire(info(100, key="k"))
        assert r.value.status == 429 and r.value.reason == "predicted_ttft_interactive"
        assert r.value.retry_after_s == 4  # the work ahead of it: the wait it would have had
        assert r.value.headers["X-Tierguard-Predicted-Wait-Ms"] == "4000.0"
        assert r.value.headers["X-Tierguard-Predicted-TTFT-Ms"] == "5000.0"
        clock.t += 1.0  # a is half done: 3 s ahead, 4 s with its own
        d = asyncio.ensure_future(c.acquire(info(100)))
        await settle()
        assert c.stats().queued["interactive"] == 2 and not d.done()
        c.first_byte(a, clock.t)  # a's prefill is over: b is sent
        await settle()
        assert b.done() and b.result().queue_wait_s == pytest.approx(1.0)
        c.check_integrity()
        for t in (a, b.result()):
            c.release(t)
        await settle()
        c.release(await d)
        c.check_integrity()
        assert c.stats().in_flight == {"interactive": 0, "batch": 0}

    asyncio.run(go())


def test_interactive_goes_before_batch():
    async def go():
        clock = Clock()
        c = controller(clock)
        a = await c.acquire(info(100))  # fills the upstream's step
        job = asyncio.ensure_future(c.acquire(RequestInfo(input_tokens=40, priority="batch", background=True)))
        batch = asyncio.ensure_future(c.acquire(info(30, "batch")))
        await settle()
        inter = asyncio.ensure_future(c.acquire(info(20)))
        await settle()
        c.first_byte(a, clock.t)
        await settle()
        assert sent_order(c) == [100, 20, 30, 40]  # the later interactive request first, async jobs last
        for t in (a, await batch, await inter, await job):
            c.release(t)
        c.check_integrity()

    asyncio.run(go())


def test_a_request_that_waited_its_budget_is_never_overtaken():
    async def go():
        clock = Clock()
        c = controller(clock, batch_ms=1300)  # 10 tokens: 0.1 s alone, a step is 1 s: a 0.2 s budget
        a = await c.acquire(info(100))
        batch = asyncio.ensure_future(c.acquire(info(10, "batch")))
        await settle()
        clock.t += 0.05
        early = asyncio.ensure_future(c.acquire(info(20)))  # interactive, before the budget ran out
        await settle()
        clock.t += 0.2  # the batch request has waited 0.25 s > its budget
        late = asyncio.ensure_future(c.acquire(info(30)))
        await settle()
        c.first_byte(a, clock.t)
        await settle()
        assert sent_order(c) == [100, 20, 10, 30]  # the batch request, due, before the later interactive one
        for t in (a, await batch, await early, await late):
            c.release(t)

    asyncio.run(go())


def test_a_rejected_client_that_retries_as_told_takes_its_place():
    async def go():
        clock = Clock()
        c = controller(clock, max_concurrency=1)  # one request upstream at a time: the rest wait here
        a = await c.acquire(info(300))  # 3 s
        with pytest.raises(Rejected) as r:
            await c.acquire(info(250, key="retry-me"))  # 5.5 s
        assert r.value.retry_after_s == 3 and c.bookings.made == 1
        clock.t += 0.1
        with pytest.raises(Rejected) as r:  # back too early: 2.9 s still ahead of its place, told again
            await c.acquire(info(250, key="retry-me"))
        assert r.value.retry_after_s == 3 and c.bookings.made == 2 and len(c.bookings) == 1
        clock.t += 2.9
        newer = asyncio.ensure_future(c.acquire(info(10)))  # arrived after the booking was made
        await settle()
        back = asyncio.ensure_future(c.acquire(info(250, key="retry-me")))  # on time: admitted, in its place
        await settle()
        assert c.bookings.claimed == 2 and c.stats().decisions[("admit", "booked_retry")] == 1
        c.release(a)
        await settle()
        assert back.done() and not newer.done()  # the booked place is ahead of the newer request
        c.release(back.result())
        c.release(await newer)
        big = await c.acquire(info(400))  # 4 s
        with pytest.raises(Rejected):
            await c.acquire(info(200, key="never-back"))  # 6 s: booked
        share = c.bookings.show_share
        clock.t += 60
        c.retry_after_s("interactive")
        c._expire(clock.t)  # its client never came back: dropped, and bookings count for less
        assert not len(c.bookings) and c.bookings.expired == 1 and c.bookings.show_share < share
        c.release(big)
        c.check_integrity()

    asyncio.run(go())


def test_math_of_the_closed_form():
    assert features(0, 0, 3, 100) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert features(250, 9.0, 10, 100) == [1.0, 250.0, 9.0, 3.0, 30.0]  # 90 prefill tokens a step
    assert keys_of(4) == 10.0 and math.isclose(OnlineFit(Prior([0.1, 0.001, 0, 0, 0])).predict(
        features(100, 0, 0, 1024)), 0.2)


def test_gates_in_front_of_one_upstream_price_each_others_queued_work(redis_server):
    from tierguard.gate.ttft_shared import SharedWork

    async def go():
        clock = Clock()
        gates = [controller(clock, shared=SharedWork(redis_server.url, prefix="t:pred", lease_ms=600))
                 for _ in range(2)]
        for g in gates:
            await g.start()
        a, b = gates
        held = await a.acquire(info(200))  # 2 s of prefill sent by gate a
        queued = asyncio.ensure_future(a.acquire(info(100)))  # and 1 s waiting there
        await settle()
        await a.shared.publish_once()
        await b.shared.publish_once()
        others = b.upstreams[0].others
        assert (others.tokens, others.sent_tokens) == (300, 200) and b.shared.live_gates == 2
        with pytest.raises(Rejected) as r:  # 3 s at gate a + 2.5 s of its own > 5 s
            await b.acquire(info(250))
        assert r.value.retry_after_s == 3
        redis_server.kill()  # gate b keeps a's last figures for one lease, then prices alone
        await b.shared.publish_once()
        assert not b.shared.up and b.upstreams[0].others.tokens == 300
        await asyncio.sleep(0.7)
        await b.shared.publish_once()
        assert b.upstreams[0].others.tokens == 0 and b.shared.errors >= 2
        a.release(held)
        a.release(await queued)
        for g in gates:
            await g.close()

    asyncio.run(go())
