"""The predicted boundary against an answer worked out by hand, and the cost model's fit.

A workload where the answer is arithmetic: c streams arrive together (closed loop, one
round), every prompt fits the first step, and a decode step costs a + b x c. With no
gaps and no client latency, every inter-token gap is exactly a + b x c, so the ITL SLO
holds up to c* = floor((SLO - a) / b), and the ladder + bisection must land there.
Scaling every cost by 1 +- band moves c* to floor((SLO / (1 +- band) - a) / b).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierguard.engine.api import StepShape
from tierguard.engine.config import EngineConfig
from tierguard.kv.spec import KVLayout
from tierguard.model.config import ModelConfig
from tierguard.predict.calibrate import Calibration, ProbePlan
from tierguard.predict.costmodel import REGIME_FEATURES, Linear, StepCost, nnls
from tierguard.predict.driver import ClientTiming
from tierguard.predict.predictor import VariantModel, predict_variant
from tierguard.predict.simengine import EngineSpec
from tierguard.sweep.matrix import parse_matrix

A_MS, B_MS, SLO_ITL = 10.0, 4.0, 52.0


def matrix():
    return parse_matrix({
        "name": "analytic",
        "variants": [{"name": "x", "command": "{python} -m tierguard serve --model tiny --port {port}"}],
        "profile": {"context_lengths": [32], "output_len": 12, "num_requests": 1, "min_rounds": 1},
        "slices": {"ladder": [1, 2, 4, 8, 16], "bisect": True},
        "slo": {"p99_ttft_ms": 10000, "p99_itl_ms": SLO_ITL},
        "uncertainty": {"bootstrap": 0},
    })


def model(band: float) -> VariantModel:
    cost = StepCost({
        "decode": Linear(REGIME_FEATURES["decode"], [A_MS / 1e3, B_MS / 1e3, 0.0]),
        "wide": Linear(REGIME_FEATURES["wide"], [0.005, 1e-5, 0.0, 0.0, 0.0]),
    })
    cfg = EngineConfig(num_blocks=4096, block_size=16, max_num_seqs=32, max_num_batched_tokens=1024,
                       max_model_len=256)
    mc = ModelConfig("LlamaForCausalLM", 512, 64, 128, 2, 4, 2, 16, 512)
    spec = EngineSpec(cfg, mc, KVLayout(2, 2, 16, 16, "float32"), "x")
    plan = ProbePlan([32], 32, [2, 4], 12)
    return VariantModel("x", spec, Calibration("tierguard", "test", cost, ClientTiming(), plan, band))


def analytic(scale: float) -> int:
    return math.floor((SLO_ITL / scale - A_MS) / B_MS + 1e-9)


def test_predicted_boundary_is_the_analytic_one_and_the_band_follows_the_cost_scale():
    band = 0.1
    res = predict_variant(matrix(), model(band), None)
    by_scale = res["boundaries"][32]
    assert by_scale[1.0].max_concurrency == analytic(1.0) == 10
    assert by_scale[1.0].first_failing == 11
    assert by_scale[1.0].limited_by == ["itl"]
    assert by_scale[1.0 + band].max_concurrency == analytic(1.0 + band) == 9
    assert by_scale[1.0 - band].max_concurrency == analytic(1.0 - band) == 11
    assert res["bands"][32] == [9, 11]
    # every gap of the passing cell is the decode step at its batch size
    v10, held = res["cells"]["ladder-ctx32-c10"]
    assert v10.p99["itl"].value == pytest.approx(A_MS + B_MS * 10, rel=1e-6)
    assert held  # 10 streams: a concurrency the probes never ran
    assert not res["cells"]["ladder-ctx32-c2"][1]


def test_cost_fit_recovers_known_coefficients_and_keeps_them_non_negative():
    rng = np.random.default_rng(3)
    shapes, secs = [], []
    for _ in range(400):
        n = int(rng.integers(1, 17))
        keys = int(n * rng.integers(100, 2000))
        shapes.append(StepShape(token_rows=n, token_row_keys=keys, sampled=n))
        secs.append((2.0 + 0.7 * n + 0.002 * keys) / 1e3 * float(np.exp(rng.normal(0, 0.03))))
    for _ in range(200):
        k = int(rng.integers(20, 300))
        shapes.append(StepShape(token_rows=2, token_row_keys=900, chunks=1, chunk_tokens=k, chunk_keys=k * 300,
                                sampled=2))
        secs.append((8.0 + 0.2 * (k + 2) + 0.00001 * (k * 300 + 900)) / 1e3)
    cost = StepCost.fit(shapes, secs, fused_max_rows=0)
    a0, a1, a2 = cost.regimes["decode"].coef
    assert a0 * 1e3 == pytest.approx(2.0, rel=0.15)
    assert a1 * 1e3 == pytest.approx(0.7, rel=0.1)
    assert a2 * 1e3 == pytest.approx(0.002, rel=0.1)
    assert cost.regime(shapes[-1]) == "wide"
    assert cost.step_seconds(shapes[-1]) == pytest.approx(secs[-1], rel=0.05)
    # residual draws average to the fitted mean
    rng2 = np.random.default_rng(0)
    draws = [cost.step_seconds(shapes[0], rng2) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(cost.step_seconds(shapes[0]), rel=0.01)
    assert StepCost.from_json(cost.to_json()).to_json() == cost.to_json()


def test_nnls_never_returns_a_negative_coefficient():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # a falling line: the unconstrained slope is negative
    x = nnls(a, b)
    assert (x >= 0).all()
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)
