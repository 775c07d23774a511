"""A predicted cell is the typical run of it: several simulated replicas, each with its
own prompts, combined per metric by the median replica's p99."""

from __future__ import annotations

import numpy as np

from tierguard.predict.driver import ClientTiming
from tierguard.predict.predictor import REPLICAS, simulate_cell, simulation, typical
from tierguard.sweep.cells import CellSpec, CellVerdict
from tierguard.sweep.stats import P99

from .test_noise_terms import one_stream_model


def verdict(ttft: float, itl: float, limit_itl: float = 100.0) -> CellVerdict:
    return CellVerdict(slice="ladder", context=32, concurrency=1, completed=12, failed=0,
                       p99={"ttft": P99(ttft), "itl": P99(itl)}, max_stall_ms=itl, passed=itl <= limit_itl,
                       missed=[] if itl <= limit_itl else ["itl"])


def test_typical_takes_each_metrics_median_replica_and_their_agreement():
    _vm, m = one_stream_model(ClientTiming())  # SLO: p99 ITL <= 100 ms
    reps = [verdict(50, 90), verdict(10, 120), verdict(30, 20), verdict(40, 110), verdict(20, 105)]
    t = typical(reps, m)
    assert t.p99["ttft"].value == 30 and t.p99["itl"].value == 105
    assert not t.passed and t.missed == ["itl"]
    assert not t.confident  # two replicas passed, three did not
    calm = typical([verdict(10, 20), verdict(12, 30), verdict(11, 25)], m)
    assert calm.passed and calm.confident and calm.p99["itl"].value == 25


def test_each_replica_sends_its_own_prompts_and_the_first_is_written(tmp_path, monkeypatch):
    # a replica repeating the first one's prompts would hit the prefix cache the first
    # one filled: not another run of the cell
    vm, m = one_stream_model(ClientTiming(0.001, 0.0005))
    sim = simulation(vm, 1.0, 3)
    seen = []
    run = sim.run

    def recording(wl):
        seen.append(tuple(map(tuple, wl.prompts)))
        return run(wl)

    monkeypatch.setattr(sim, "run", recording)
    v = simulate_cell(m, vm, sim, CellSpec("ladder", 32, 1), tmp_path / "cell", False)
    assert len(seen) == REPLICAS >= 3 and len(set(seen)) == REPLICAS
    assert v.completed == 12 and v.passed
    written = (tmp_path / "cell" / "r0" / "requests.jsonl").read_text().splitlines()
    assert len(written) == 12 and not (tmp_path / "cell" / "r1").exists()
    assert np.isfinite(v.p99["itl"].value)
