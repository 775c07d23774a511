from __future__ import annotations

import json
import re

from tierguard.report import write_report
from tierguard.report.load import load_run, parse_counters


def test_writes_all_files_with_the_boundary(run_dir, tmp_path):
    files = write_report(run_dir, tmp_path / "out")
    b = json.loads(files.boundary_json.read_text())
    assert b["variants"]["small"]["contexts"]["64"]["max_concurrency"] == 3
    assert b["variants"]["big"]["contexts"]["256"]["max_concurrency"] == 6
    assert b["variants"]["broken"]["status"] == "failed"
    assert b["variants"]["broken"]["contexts"]["64"] is None
    names = {p.stem for p in files.plots}
    assert {"boundary", "p99_ttft", "p99_itl", "cdf_ttft", "cdf_itl", "stalls"} <= names
    for p in files.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_self_contained(run_dir, tmp_path):
    files = write_report(run_dir, tmp_path / "out")
    html = files.html.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), (
        "page loads something from the network"
    )
    assert "<link" not in html and "<script src" not in html
    assert html.count('src="data:image/png;base64,') == len(files.plots)
    assert "Recommendation" in html and "failed" in html


# Written from the fixture, not from the code under test: "small" serves 3 at once and
# "big" 6 (conftest `caps`), beyond that requests queue, so TTFT is the SLO that breaks;
# "broken" never starts. Same at both context lengths.
EXPECTED_BOUNDARY = """\
| variant | status | ctx 64 | ctx 256 |
|---|---|---|---|
| small | done | 3 (ttft) | 3 (ttft) |
| broken | failed | failed | failed |
| big | done | 6 (ttft) | 6 (ttft) |
"""


def test_markdown_has_the_same_boundary_table(run_dir, tmp_path):
    files = write_report(run_dir, tmp_path / "out")
    md = files.markdown.read_text()
    assert EXPECTED_BOUNDARY in md
    for p in files.plots:
        assert f"plots/{p.name}" in md
        assert p.exists()


def test_counters_and_recommendation(run_dir, tmp_path):
    data = load_run(run_dir)
    small = next(v for v in data.variants if v.name == "small")
    names = {n for n, _, _ in small.counters}
    assert "tierguard_kv_host_tier_hits_total" in names and "tierguard_queue_depth" in names
    assert "process_cpu_seconds_total" not in names  # not a tier/engine signal
    files = write_report(run_dir, tmp_path / "out")
    recs = " ".join(files.recommendations)
    assert "big holds the SLOs up to concurrency 6" in recs
    assert "broken did not run" in recs


def test_parse_counters_survives_garbage():
    assert parse_counters("this is { not prometheus") == []


def test_report_refuses_cells_with_different_profiles(run_dir, tmp_path):
    import shutil

    import pytest

    from tierguard.common.errors import TierguardError

    bad = tmp_path / "copy"
    shutil.copytree(run_dir, bad)
    state = json.loads((bad / "state.json").read_text())
    state["cells"]["big"]["ladder-ctx64-c1"]["fingerprint"] = "different"
    run_json = bad / "big" / "ladder-ctx64-c1" / "r0" / "run.json"
    run = json.loads(run_json.read_text())
    run["fingerprint"] = "different"
    run["profile"]["output-len"] = "17"
    run_json.write_text(json.dumps(run))
    (bad / "state.json").write_text(json.dumps(state))
    with pytest.raises(TierguardError, match="output-len: '16' != '17'"):
        load_run(bad)


def test_prefix_slice_table_and_recommendation(run_dir, tmp_path):
    from tierguard.report.tables import prefix_table

    data = load_run(run_dir)
    t = prefix_table(data)
    assert [r[0] for r in t.rows] == ["small", "big"]
    p50 = {r[0]: float(r[t.header.index("p50 TTFT ms")]) for r in t.rows}
    assert p50["big"] < p50["small"]  # the fake "small" prefills 10x slower on this slice
    files = write_report(run_dir, tmp_path / "out")
    recs = " ".join(files.recommendations)
    assert "big turns recompute into loads" in recs and "for small, which recomputes" in recs
    assert "Prefix reuse" in files.markdown.read_text() and "Prefix reuse" in files.html.read_text()


def test_boundary_comes_before_the_recommendation(run_dir, tmp_path, capsys):
    from tierguard.cli.report import print_boundary

    files = write_report(run_dir, tmp_path / "out")
    for text in (files.markdown.read_text(), files.html.read_text()):
        assert 0 <= text.index("Boundary") < text.index("Recommendation")
    print_boundary(run_dir, files.recommendations)
    out = capsys.readouterr().out
    assert out.index("Boundary") < out.index("Recommendation") < out.index(files.recommendations[0][:20])


def test_samples_of_a_cell_are_read_once(run_dir, monkeypatch):
    import tierguard.report.load as load_mod

    data = load_run(run_dir)
    calls = []
    real = load_mod.load_samples
    monkeypatch.setattr(load_mod, "load_samples", lambda d: calls.append(d) or real(d))
    first = data.samples("small", "ladder-ctx64-c1")
    second = data.samples("small", "ladder-ctx64-c1")
    assert first and first == second
    assert len(calls) == len({*calls})  # each repeat directory parsed exactly once
