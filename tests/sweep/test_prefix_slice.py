"""The prefix-reuse slice and the shared-prefix profile: matrix fields and bench arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweep.fake_bench import flag
from tierguard.common.errors import TierguardError
from tierguard.sweep.benchcall import bench_argv
from tierguard.sweep.cells import CellSpec
from tierguard.sweep.matrix import parse_matrix


def _matrix(**over) -> dict:
    m = {
        "variants": [{"name": "a", "base_url": "http://127.0.0.1:1"}],
        "profile": {"context_lengths": [256], "output_len": 8, "num_requests": 4},
        "slo": {"p99_ttft_ms": 100, "p99_itl_ms": 10},
    }
    for k, v in over.items():
        m[k] = {**m.get(k, {}), **v}
    return m


def test_prefix_slice_argv_makes_prompts_of_the_slice_context():
    m = parse_matrix(
        _matrix(slices={"prefix": {"context": "1k", "prefix_share": 0.75, "num_prefixes": 8, "concurrency": [2]}})
    )
    pre = m.slices.prefix
    assert pre is not None and pre.context == 1024 and pre.prefix_len == 768
    argv = bench_argv(m, CellSpec("prefix", 1024, 2), "http://x", "m", Path("/o"))
    assert flag(argv, "--dataset") == "shared-prefix"
    assert int(flag(argv, "--prefix-len")) + int(flag(argv, "--input-len")) == 1024
    assert flag(argv, "--num-prefixes") == "8"
    # Every prefix is reused: the request count is prefixes x requests per prefix.
    assert int(flag(argv, "--num-requests")) == 8 * int(flag(argv, "--requests-per-prefix")) == 24
    # The ladder of the same matrix keeps the profile's own dataset.
    assert flag(bench_argv(m, CellSpec("ladder", 256, 2), "http://x", "m", Path("/o")), "--dataset") == "fixed"


def test_prefix_argv_is_the_same_for_every_variant():
    m = parse_matrix(_matrix(slices={"prefix": {"context": 512}}))
    spec = CellSpec("prefix", 512, 2)
    a = bench_argv(m, spec, "http://a:1", "m", Path("/a"))
    b = bench_argv(m, spec, "http://b:2", "m", Path("/b"))
    strip = {"--base-url", "--output-dir"}
    drop = lambda argv: [x for i, x in enumerate(argv) if x not in strip and argv[i - 1] not in strip]  # noqa: E731
    assert drop(a) == drop(b)


def test_shared_prefix_profile_covers_the_cell_request_count():
    m = parse_matrix(
        _matrix(profile={"dataset": "shared-prefix", "prefix_share": 0.5, "num_prefixes": 3, "min_rounds": 2})
    )
    argv = bench_argv(m, CellSpec("ladder", 256, 4), "http://x", "m", Path("/o"))
    assert flag(argv, "--prefix-len") == "128" and flag(argv, "--input-len") == "128"
    n = int(flag(argv, "--num-requests"))
    assert n == 8 and 3 * int(flag(argv, "--requests-per-prefix")) >= n


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"slices": {"prefix": {"context": 1}}}, "slices.prefix.context"),
        ({"slices": {"prefix": {"requests_per_prefix": 1}}}, "slices.prefix.requests_per_prefix"),
        ({"slices": {"prefix": {"prefix_share": 1.0}}}, "slices.prefix.prefix_share"),
        ({"profile": {"dataset": "shared-prefix", "context_lengths": [1]}}, "prefix + suffix"),
        ({"profile": {"dataset": "sessions"}}, "profile.dataset"),
    ],
)
def test_bad_prefix_settings_name_the_field(over, needle):
    with pytest.raises(TierguardError, match=needle.replace("+", r"\+").replace(".", r"\.")):
        parse_matrix(_matrix(**over))
