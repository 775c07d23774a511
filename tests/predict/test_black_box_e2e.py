"""A black-box engine end to end: calibrate against a real server whose token schedule is
known (tierguard.bench.schedule_server: first token 60 ms after arrival, then one every
20 ms, any number of streams), predict a matrix, sweep it for real, compare. Slow: the
probes and the sweep are real bench runs."""

from __future__ import annotations

import json

import pytest
from sweep.helpers import schedule_variant

from tierguard.engine.api import StepShape
from tierguard.predict.calibrate import Calibration
from tierguard.predict.predictor import predict_matrix
from tierguard.report.load import load_run
from tierguard.report.predicted import boundary_pairs, cell_errors
from tierguard.sweep.matrix import parse_matrix
from tierguard.sweep.runner import Sweep


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_known_server_is_predicted_within_the_tolerance(tmp_path):
    m = parse_matrix({
        "name": "known",
        "variants": [schedule_variant("known", 0, ttft_ms=60, itl_ms=20)],
        "profile": {"context_lengths": [64], "output_len": 12, "num_requests": 6, "min_rounds": 1},
        "slices": {"ladder": [1, 2, 4], "bisect": False},
        "slo": {"p99_ttft_ms": 2000, "p99_itl_ms": 200},
        "uncertainty": {"bootstrap": 0},
    })
    logs: list[str] = []
    doc = predict_matrix(m, tmp_path / "predicted", tmp_path / "cache", logs.append)
    assert doc["variants"]["known"]["status"] == "done", logs
    assert doc["calibration"]["known"]["engine"] == "generic"
    (cached,) = (tmp_path / "cache").glob("generic-*.json")
    cost = Calibration.from_json(json.loads(cached.read_text())).cost
    for c in (1, 2, 4):  # the decode step the server really has: 20 ms, whatever the streams
        assert cost.step_seconds(StepShape(token_rows=c, token_row_keys=c * 70, sampled=c)) == pytest.approx(
            0.020, rel=0.5)
    Sweep(m, tmp_path / "measured").run()
    measured, predicted = load_run(tmp_path / "measured"), load_run(tmp_path / "predicted")
    pairs = boundary_pairs(measured, predicted)
    assert [(p.measured, p.predicted) for p in pairs] == [(4, 4)]
    errs = cell_errors(measured, predicted)
    assert len(errs) == 6
    # p99s within a factor of two: the machine's jitter (client and server share it) is in
    # both; bench/predict_validation.py holds them to 20 % on a quiet machine
    assert all(abs(e.error) <= 1.0 for e in errs), [(e.concurrency, e.metric, e.measured_ms, e.predicted_ms)
                                                      for e in errs]
