from __future__ import annotations

import math

import pytest

from tierguard.common.errors import TierguardError
from tierguard.sweep.matrix import load_matrix, parse_matrix

BASE = {
    "variants": [
        {"name": "a", "command": "srv --port {port}"},
        {"name": "b", "base_url": "http://127.0.0.1:9"},
    ],
    "slo": {"p99_ttft_ms": 500, "p99_itl_ms": 50},
}


def test_parses_token_suffixes_and_defaults():
    m = parse_matrix(
        {
            **BASE,
            "profile": {"context_lengths": ["2k", "8k", 100], "output_len": "256", "request_rate": "inf"},
        }
    )
    assert m.profile.context_lengths == [2048, 8192, 100]
    assert m.profile.output_len == 256
    assert math.isinf(m.profile.request_rate)
    assert m.variants[0].managed and not m.variants[1].managed
    assert m.slo.limits() == {"ttft": 500, "itl": 50}
    assert m.profile.requests_for(64) == 4 * 64  # min_rounds x concurrency beats num_requests


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"variants": [{"name": "x", "command": "a", "base_url": "http://h"}]}, "exactly one of"),
        ({"variants": [{"name": "x"}]}, "exactly one of"),
        (
            {"variants": [{"name": "x", "command": "a"}, {"name": "x", "command": "b"}]},
            "duplicate variant names: x",
        ),
        ({"variants": [{"name": "bad name!", "command": "a"}]}, "variant name"),
        ({"slices": {"ladder": [4, 2]}}, "slices.ladder"),
        ({"profile": {"context_lengths": ["2q"]}}, "profile.context_lengths"),
        ({"slo": {"p99_ttft_ms": 500}}, "slo.p99_itl_ms"),
        ({"profile": {"unknown_knob": 1}}, "profile.unknown_knob"),
        ({"variants": [{"name": "x", "base_url": "localhost:8000"}]}, "http://"),
    ],
)
def test_errors_name_the_field(patch, needle):
    with pytest.raises(TierguardError) as e:
        parse_matrix({**BASE, **patch})
    assert needle in str(e.value)


def test_load_matrix_file_errors(tmp_path):
    with pytest.raises(TierguardError, match="not found"):
        load_matrix(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("variants: [\n")
    with pytest.raises(TierguardError, match="not valid YAML"):
        load_matrix(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(TierguardError, match="mapping"):
        load_matrix(lst)


def test_example_matrices_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "examples").glob("*.yaml"))
    assert {f.stem for f in files} >= {"vllm", "sglang", "llamacpp", "tierguard-serve"}
    for f in files:
        m = load_matrix(f)
        assert m.variants and all(v.managed for v in m.variants)
        for v in m.variants:
            assert "{port}" in " ".join(v.command if isinstance(v.command, list) else [v.command])
