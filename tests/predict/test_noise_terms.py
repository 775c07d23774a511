"""The model's calibrated terms beyond the step cost: the per-token delivery latency
(its spread reaches the simulated inter-token p99) and the naive pager's repeat spill
(a block already on disk is not written again)."""

from __future__ import annotations

import numpy as np
import pytest

from tierguard.bench.records import OK, RequestRecord
from tierguard.engine.config import EngineConfig
from tierguard.kv.spec import KVLayout
from tierguard.model.config import ModelConfig
from tierguard.predict.calibrate import Calibration, ProbePlan, ProbeRun, client_timing
from tierguard.predict.driver import ClientTiming
from tierguard.predict.media import ROUTES, MediaCost, RouteCost, measure_media
from tierguard.predict.predictor import VariantModel, simulation
from tierguard.predict.simengine import EngineSpec, SimClock, SimNaiveDisk
from tierguard.predict.workload import cell_workload
from tierguard.sweep.cells import CellSpec
from tierguard.sweep.matrix import parse_matrix

from .conftest import pinned_cost


def test_delivery_is_measured_from_the_step_that_made_the_token():
    # steps end at 10.01, 10.02, 10.03, each sampling one token; the client saw the first
    # token 15 ms late, after the second step had ended too
    steps = [{"started": 10.0 + 0.01 * i, "duration": 0.01, "sampled": 1} for i in range(3)]
    rec = RequestRecord(0, sent_s=-0.005, scheduled_s=-0.005, chunk_times_s=[0.025, 0.026, 0.032],
                        chunk_tokens=[1, 1, 1], status=OK)
    t = client_timing(steps, [ProbeRun("single", 16, 1, 10.0, 9.995, 10.04, [rec])])
    assert t.first_deliver_s == pytest.approx(0.015)  # the first token: TTFT's, kept apart
    assert t.deliver_samples_s == pytest.approx([0.002, 0.006])
    assert t.deliver_s == pytest.approx(0.004)
    back = ClientTiming.from_json(t.to_json())
    assert back.deliver_samples_s == pytest.approx(t.deliver_samples_s) and back.first_deliver_s == pytest.approx(0.015)


def one_stream_model(client: ClientTiming) -> tuple[VariantModel, object]:
    m = parse_matrix({
        "name": "noise",
        "variants": [{"name": "x", "command": "{python} -m tierguard serve --model tiny --port {port}"}],
        "profile": {"context_lengths": [32], "output_len": 64, "num_requests": 12, "min_rounds": 1},
        "slices": {"ladder": [1], "bisect": False},
        "slo": {"p99_ttft_ms": 10000, "p99_itl_ms": 100},
        "uncertainty": {"bootstrap": 0},
    })
    cfg = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    mc = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 512)
    spec = EngineSpec(cfg, mc, KVLayout(2, 2, 16, 16, "float32"), "x")
    cal = Calibration("tierguard", "t", pinned_cost(decode_ms=(1.0, 0.0, 0.0)), client, ProbePlan([32], 32, [2], 64))
    return VariantModel("x", spec, cal), m


def one_stream_records(client: ClientTiming) -> list[RequestRecord]:
    vm, m = one_stream_model(client)
    sim = simulation(vm, 1.0, 7)
    return sim.run(cell_workload(m, CellSpec("ladder", 32, 1), vm.spec.model_config.vocab_size))


def itl_percentiles(client: ClientTiming) -> tuple[float, float]:
    itl = np.concatenate([r.itl_samples_ms() for r in one_stream_records(client)])
    return float(np.percentile(itl, 50)), float(np.percentile(itl, 99))


def test_a_first_token_takes_the_first_tokens_delivery():
    flat = one_stream_records(ClientTiming(0.001, 0.0001))
    first = one_stream_records(ClientTiming(0.001, 0.0001, [], first_deliver_s=0.005))
    for a, b in zip(flat, first, strict=True):
        assert b.ttft_ms - a.ttft_ms == pytest.approx(4.9, abs=0.01)
    assert np.percentile(np.concatenate([r.itl_samples_ms() for r in first]), 99) < 1.01


def test_calibrated_delivery_noise_raises_the_itl_p99_and_keeps_its_median():
    # one stream, 1 ms steps: every gap is the step unless delivery varies. Measured
    # deliveries: mostly 0.1 ms, one in twenty-five 3 ms late (the event loop, the OS)
    samples = [0.0001] * 96 + [0.003] * 4
    p50_flat, p99_flat = itl_percentiles(ClientTiming(0.001, 0.0001))
    p50_noisy, p99_noisy = itl_percentiles(ClientTiming(0.001, 0.0001, samples))
    assert p99_flat == pytest.approx(1.0, abs=0.01)
    assert p99_noisy > 2.5  # a late token's gap is the step plus the lateness
    assert p50_noisy == pytest.approx(p50_flat, rel=0.05)


def media(spill_ms: float, respill_ms: float, restore_ms: float) -> MediaCost:
    routes = {r: RouteCost(0.0, 0.0) for r in ROUTES}
    routes.update(naive_spill=RouteCost(0.0, spill_ms / 1e3), naive_respill=RouteCost(0.0, respill_ms / 1e3),
                  naive_restore=RouteCost(0.0, restore_ms / 1e3))
    return MediaCost(routes, 1024)


def test_naive_repeat_spill_of_a_block_on_disk_costs_the_measured_repeat():
    clock = SimClock()
    disk = SimNaiveDisk(clock, media(4.0, 0.5, 2.0), None, 1.0)
    for expect_ms, op in [(4.0, disk.spill), (2.0, disk.restore), (0.5, disk.spill), (4.0, lambda h, b: disk.spill(9, b))]:
        before = clock.now
        assert op(7, 0)
        assert (clock.now - before) * 1e3 == pytest.approx(expect_ms)
    assert disk.counters.spills == 3 and disk.counters.restores == 1


def test_naive_spill_tier_evicts_least_recently_used_blocks_at_its_budget():
    disk = SimNaiveDisk(SimClock(), media(4.0, 0.5, 2.0), None, 1.0, capacity_blocks=2)
    for h in (1, 2, 3):  # 1 is evicted
        assert disk.spill(h, 0)
    assert not disk.restore(1, 0) and disk.restore(2, 0)  # reading 2 makes 3 the oldest
    assert disk.spill(4, 0) and not disk.restore(3, 0)
    before = disk.clock.now
    assert disk.spill(2, 0)  # a repeat: nothing written, nothing evicted, not moved up
    assert (disk.clock.now - before) * 1e3 == pytest.approx(0.5)
    assert disk.spill(5, 0) and not disk.restore(2, 0) and disk.restore(4, 0)
    assert disk.counters.restore_misses == 3


def test_a_calibration_without_a_repeat_spill_charges_the_first_spills_time():
    m = media(4.0, 0.5, 2.0)
    del m.routes["naive_respill"]
    assert m.route("naive_respill").per_block_s == pytest.approx(0.004)


def test_media_probe_times_every_route_with_the_tiers_own_classes(tmp_path):
    cost = measure_media(KVLayout(2, 2, 16, 16, "float32"), tmp_path)
    assert set(cost.routes) == set(ROUTES)
    for name in ("naive_spill", "naive_respill", "naive_restore", "host_to_disk"):
        assert cost.routes[name].seconds(1) > 0


def ar1_decode_steps(rho: float, n: int = 600, seed: int = 5) -> tuple[list, list[float]]:
    """Decode steps of 1-8 rows whose log noise is an AR(1) with correlation `rho`."""
    from tierguard.engine.api import StepShape

    rng = np.random.default_rng(seed)
    shapes, secs, z = [], [], 0.0
    for _ in range(n):
        rows = int(rng.integers(1, 9))
        z = rho * z + np.sqrt(1 - rho * rho) * rng.normal()
        shapes.append(StepShape(token_rows=rows, token_row_keys=rows * 100, sampled=rows))
        secs.append((1.0 + 0.5 * rows) / 1e3 * float(np.exp(0.3 * z)))
    return shapes, secs


def test_step_noise_keeps_the_measured_correlation_of_successive_steps():
    # a slow step is followed by more: the fit measures it and the simulated engine
    # replays it, each step still drawn from the measured residuals
    from types import SimpleNamespace

    from tierguard.engine.api import StepShape
    from tierguard.predict.costmodel import REGIME_FEATURES, Linear, StepCost
    from tierguard.predict.simengine import SimRunner

    def fit(shapes, secs) -> StepCost:
        return StepCost({"decode": Linear.fit(REGIME_FEATURES["decode"], shapes, secs)})

    shapes, secs = ar1_decode_steps(0.7)
    cost = fit(shapes, secs)
    cost.rho = cost.residual_correlation(shapes, secs)
    assert 0.55 < cost.rho < 0.85
    assert StepCost.from_json(cost.to_json()).rho == cost.rho
    shapes0, secs0 = ar1_decode_steps(0.0)
    assert fit(shapes0, secs0).residual_correlation(shapes0, secs0) < 0.15

    vm, _ = one_stream_model(ClientTiming())
    batch = [SimpleNamespace(seq=SimpleNamespace(num_computed_tokens=99), num_tokens=1, samples=True)] * 4

    def durations(c: StepCost) -> np.ndarray:
        runner = SimRunner(vm.spec, c, SimClock(), np.random.default_rng(1), 1.0)
        out = []
        for _ in range(3000):
            before = runner.clock.now
            runner.run(batch)
            out.append(runner.clock.now - before)
        return np.asarray(out)

    d = durations(cost)
    assert np.corrcoef(np.log(d[:-1]), np.log(d[1:]))[0, 1] > 0.5
    mean = cost.step_seconds(StepShape.of(batch))
    assert np.mean(d) == pytest.approx(mean, rel=0.05)  # the marginal is the residuals'
    cost.rho = 0.0
    d0 = durations(cost)
    assert abs(np.corrcoef(np.log(d0[:-1]), np.log(d0[1:]))[0, 1]) < 0.1
    assert np.mean(d0) == pytest.approx(mean, rel=0.05)
