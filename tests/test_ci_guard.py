"""The CI guard (tests/needs.py): under CI=true a missing kernel build fails the run at
start with the compiler's words, and a skip for any reason but CUDA fails it at the end;
outside CI the same skips stay skips, named. Each case runs pytest in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SKIPS = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs CUDA")
def test_cuda():
    pass

def test_redis():
    pytest.skip("needs redis-server (Debian package redis-server: apt-get install -y redis-server)")
'''


def _pytest(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    if "CI" not in env:
        full.pop("CI", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def _suite(tmp_path: Path, body: str) -> Path:
    """A throwaway suite whose conftest installs the guard's end-of-run hooks only (its
    session-start check would look at this machine's kernels, Redis and model)."""
    (tmp_path / "conftest.py").write_text(
        "from tests.needs import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa\n"
    )
    (tmp_path / "test_some.py").write_text(body)
    return tmp_path


def test_in_ci_a_skip_that_is_not_about_cuda_fails_the_run(tmp_path):
    suite = _suite(tmp_path, SKIPS)
    res = _pytest(suite, CI="true")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "SKIPPED IN CI test_some.py::test_redis: needs redis-server" in res.stdout
    assert "test_cuda" not in res.stdout.split("skips that are not about CUDA")[1]
    outside = _pytest(suite)  # the same suite outside CI: green, the skips named
    assert outside.returncode == 0, outside.stdout
    assert "needs redis-server" in outside.stdout and "needs CUDA" in outside.stdout


def test_in_ci_cuda_skips_alone_pass(tmp_path):
    suite = _suite(tmp_path, SKIPS.replace("def test_redis():", "def _not_collected():"))
    res = _pytest(suite, CI="true")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 1 skipped" in res.stdout


def test_in_ci_a_kernel_build_failure_ends_the_run_at_start(tmp_path):
    """A compiler that fails (CC=/bin/false) and no kernel library cached: the run ends
    before any test, saying why; outside CI the same state only skips the kernel tests."""
    cache = tmp_path / "cache"
    cache.mkdir()
    probe = "tests/test_ci_guard.py::test_in_ci_cuda_skips_alone_pass"
    res = _pytest(ROOT, probe, CI="true", CC="/bin/false", TIERGUARD_CACHE=str(cache))
    assert res.returncode == 3, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "CI=true: the suite cannot run what it must" in out and "/bin/false failed" in out, out
    assert "passed" not in out


NEEDS_A_PACKAGE = '''
from tests.needs import need_module

def test_with_it():
    need_module("json")

def test_without_it():
    need_module("no_such_package_anywhere", "pip install it")
'''


def test_a_missing_python_package_skips_its_test_outside_ci_and_fails_it_in_ci(tmp_path):
    suite = _suite(tmp_path, NEEDS_A_PACKAGE)
    outside = _pytest(suite)
    assert outside.returncode == 0, outside.stdout + outside.stderr
    assert "1 passed, 1 skipped" in outside.stdout
    assert "needs the Python package 'no_such_package_anywhere' (pip install it)" in outside.stdout
    ci = _pytest(suite, CI="true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "1 failed, 1 passed" in ci.stdout and "CI=true: needs the Python package" in ci.stdout
