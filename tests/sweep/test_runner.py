from __future__ import annotations

import json
from pathlib import Path

import pytest

from sweep.fake_bench import ServerModel, flag, make_bench
from sweep.helpers import failing_variant, schedule_variant
from tierguard.common.errors import TierguardError
from tierguard.sweep.matrix import parse_matrix
from tierguard.sweep.runner import Sweep


def matrix(variants, **over):
    doc = {
        "name": "t",
        "variants": variants,
        "profile": {"context_lengths": [64, 128], "output_len": 16, "num_requests": 8},
        "slices": {"ladder": [1, 2, 4, 8, 16]},
        "slo": {"p99_ttft_ms": 200, "p99_itl_ms": 50},
        "uncertainty": {"bootstrap": 50},
    }
    doc.update(over)
    return parse_matrix(doc)


def test_boundaries_follow_capacity_and_failed_variant_does_not_stop_the_sweep(tmp_path):
    # The fake bench plays servers of capacity 3 then 6; the real engines only answer health/warm-up.
    models = iter([ServerModel(capacity=3), ServerModel(capacity=6)])
    benches = {}

    def bench(argv, log, timeout):
        url = flag(argv, "--base-url")
        if url not in benches:
            benches[url] = make_bench(next(models))
        return benches[url](argv, log, timeout)

    m = matrix([schedule_variant("small", 3), failing_variant(), schedule_variant("big", 6)])
    doc = Sweep(m, tmp_path, bench=bench).run()
    small, broken, big = (doc["variants"][n] for n in ("small", "broken", "big"))
    assert broken["status"] == "failed" and "code 3" in broken["error"]
    for v, cap in ((small, 3), (big, 6)):
        assert v["status"] == "done"
        for ctx in ("64", "128"):
            b = v["contexts"][ctx]
            assert b["max_concurrency"] == cap and b["first_failing"] == cap + 1
            assert b["limited_by"] == ["ttft"]
            assert b["uncertainty"]["at_boundary"]["ttft"]["p99_ms"] < 200
    saved = json.loads((tmp_path / "boundary.json").read_text())
    assert saved["variants"]["big"]["contexts"]["64"]["max_concurrency"] == 6
    assert (tmp_path / "small" / "engine.log").exists()
    assert json.loads((tmp_path / "small" / "engine.json").read_text())["stop"] == "sigterm"


def test_identical_profile_for_every_variant(tmp_path):
    model = ServerModel(capacity=4)
    bench = make_bench(model)
    Sweep(matrix([schedule_variant("a", 4), schedule_variant("b", 4)]), tmp_path, bench=bench).run()

    def strip(argv):
        return [
            x
            for i, x in enumerate(argv)
            if x not in ("--base-url", "--output-dir") and argv[i - 1] not in ("--base-url", "--output-dir")
        ]

    per_variant = {}
    for argv in model.calls:
        variant = flag(argv, "--output-dir").split("/")[-3]
        per_variant.setdefault(variant, []).append(strip(argv))
    assert per_variant["a"] == per_variant["b"]
    assert len(per_variant["a"]) > 4


def test_resume_skips_completed_cells(tmp_path):
    model = ServerModel(capacity=4)
    inner = make_bench(model)
    budget = {"left": 5}

    def interrupted(argv, log, timeout):
        if budget["left"] == 0:
            raise KeyboardInterrupt
        budget["left"] -= 1
        return inner(argv, log, timeout)

    m = matrix([schedule_variant("a", 4)])
    with pytest.raises(KeyboardInterrupt):
        Sweep(m, tmp_path, bench=interrupted).run()
    done_before = [flag(a, "--output-dir") for a in model.calls]
    assert len(done_before) == 5
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["variants"]["a"]["status"] == "running"
    model2 = ServerModel(capacity=4)
    doc = Sweep(m, tmp_path, bench=make_bench(model2)).run()
    rerun = [flag(a, "--output-dir") for a in model2.calls]
    assert not set(rerun) & set(done_before), "a completed cell was run again"
    assert doc["variants"]["a"]["contexts"]["128"]["max_concurrency"] == 4
    # a third run has nothing left to do and starts no engine
    model3 = ServerModel(capacity=4)
    Sweep(m, tmp_path, bench=make_bench(model3)).run()
    assert model3.calls == []


def test_run_dir_of_another_matrix_is_refused(tmp_path):
    Sweep(
        matrix([schedule_variant("a", 4)], slices={"ladder": [1]}), tmp_path, bench=make_bench(ServerModel())
    ).run()
    with pytest.raises(TierguardError, match="different matrix"):
        Sweep(matrix([schedule_variant("a", 4)], slices={"ladder": [1, 2]}), tmp_path)


def test_differing_fingerprints_are_refused_with_the_difference_named(tmp_path):
    models = {"a": ServerModel(), "b": ServerModel(profile_override={"output-len": "999"})}

    def bench(argv, log, timeout):
        name = flag(argv, "--output-dir").split("/")[-3]
        return make_bench(models[name])(argv, log, timeout)

    m = matrix([schedule_variant("a", 4), schedule_variant("b", 4)], slices={"ladder": [1]})
    with pytest.raises(TierguardError) as e:
        Sweep(m, tmp_path, bench=bench).run()
    assert "output-len: '16' != '999'" in str(e.value) or "output-len: '999' != '16'" in str(e.value)


def test_failures_count_as_slo_misses(tmp_path):
    m = matrix(
        [schedule_variant("a", 64)], profile={"context_lengths": [64], "output_len": 16, "num_requests": 40}
    )
    doc = Sweep(m, tmp_path, bench=make_bench(ServerModel(capacity=64, fail_every=10))).run()
    b = doc["variants"]["a"]["contexts"]["64"]
    assert b["max_concurrency"] is None  # 10 % failures: no concurrency meets the SLO
    assert set(b["limited_by"]) >= {"ttft"}


def test_seed_differs_per_cell_but_not_per_variant():
    from tierguard.sweep.benchcall import bench_argv
    from tierguard.sweep.cells import CellSpec

    m = matrix([schedule_variant("a", 4)])
    seeds = {}
    for c in (1, 2, 4):
        for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"):
            argv = bench_argv(m, CellSpec("ladder", 64, c), url, "m", Path("/x"))
            seeds.setdefault(c, set()).add(flag(argv, "--seed"))
    assert all(len(s) == 1 for s in seeds.values())  # the same for both engines
    assert len({next(iter(s)) for s in seeds.values()}) == 3  # no prefix-cache reuse across cells


def test_timeline_records_every_cell_between_engine_start_and_stop(tmp_path):
    m = matrix([schedule_variant("a", 4)], profile={"context_lengths": [64], "output_len": 16, "num_requests": 8})
    Sweep(m, tmp_path, bench=make_bench(ServerModel(capacity=4))).run()
    events = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["engine_starting", "engine_ready"] and kinds[-1] == "engine_stopped"
    times = [e["t"] for e in events]
    assert times == sorted(times)
    cells = json.loads((tmp_path / "state.json").read_text())["cells"]["a"]
    started = [e["cell"] for e in events if e["kind"] == "cell_start"]
    done = [e["cell"] for e in events if e["kind"] == "cell_done"]
    assert started == done and sorted(done) == sorted(cells)  # one start and one end per cell run
    assert "ladder-ctx64-c5" in done  # the first miss above capacity 4 was measured
