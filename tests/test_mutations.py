"""Mutation check: each headline claim has a default test that fails when the code breaks it.

A mutant is one exact text replacement in one source file, plus the default tests that
must kill it. The text must occur exactly once in the file, so a mutant that no longer
matches the code (the code moved on) fails here loudly instead of passing silently.

How a mutant is run: the package, the tests and pyproject.toml are copied to a temp dir,
the replacement is made in the copy, and the killing tests run in a subprocess with the
copy as working directory and first on PYTHONPATH, so the test process and every child it
starts (servers, CLIs) import the mutated copy. With -x, the run must end in failed tests
(pytest exit code 1), not in a collection or usage error (a renamed test is reported as
such). First the same tests must pass on an unmutated copy, or a mutant's "kill" would
mean nothing.

Adding a mutant is one entry in MUTANTS. A mutant whose killers are expensive (they load
transformers) is `slow=True`: it runs with `make test-all`, not in the default suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # source file, relative to the repository root
    old: str  # exact text, present exactly once
    new: str
    killers: tuple[str, ...]  # pytest node ids of default tests; the run of them must fail
    slow: bool = False


MUTANTS = [
    Mutant(
        "sse: a 4-token chunk counted as one token",
        "tierguard/bench/sse.py",
        "rec.chunk_tokens.append(ct - self.last_ct)",
        "rec.chunk_tokens.append(1)",
        ("tests/bench/test_accuracy.py::test_four_tokens_per_chunk_read_as_four_tokens[aiohttp]",),
    ),
    Mutant(
        "admission: a request admitted without a slot check",
        "tierguard/gate/admission.py",
        "if self._can_run(klass) and not self._queues[klass]:",
        "if not self._queues[klass]:",
        ("tests/gate/test_admission.py::test_full_queue_rejects_with_retry_after",
         "tests/gate/test_admission.py::test_queue_then_fifo_handover"),
    ),
    Mutant(
        "plan: K and V counted once",
        "tierguard/plan/kv.py",
        "return 2 * fmt.bytes_for(width) + 2 * heads * fmt.scale_bytes_per_token_head",
        "return fmt.bytes_for(width) + heads * fmt.scale_bytes_per_token_head",
        ("tests/plan/test_plan_layers.py::test_article_example_128kib_per_token_4gib_per_sequence_32gib_for_eight",),
    ),
    Mutant(
        "guard: a disk read inside a decode step does not raise",
        "tierguard/kv/guard.py",
        "    if decode_in_progress():\n        raise ColdContractViolation(",
        "    if False:\n        raise ColdContractViolation(",
        ("tests/kv/test_kv_disk_tier.py::test_decode_guard_refuses_disk_reads",),
    ),
    Mutant(
        "model: keys rotated the wrong way (greedy parity with transformers breaks)",
        "tierguard/model/layers.py",
        "k * cos + _rotate_half(k) * sin",
        "k * cos - _rotate_half(k) * sin",
        ("tests/engine/test_hf_parity.py::test_parity_variants[qwen2]",),
        slow=True,  # ~12 s of CPU: transformers' import and forward
    ),
]
FAST = [m for m in MUTANTS if not m.slow]
SLOW = [m for m in MUTANTS if m.slow]


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")  # no stale bytecode in a copy


def _copy_tree(dest: Path) -> Path:
    for name in ("tierguard", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=_IGNORE)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _env(copy: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(copy) + (os.pathsep + path if path else "")}


def _pytest(copy: Path, node_ids: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *node_ids],
        cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _pristine(dest: Path, mutants: list[Mutant]) -> Path:
    """An unmutated copy on which the mutants' killing tests pass, importing the copy itself."""
    copy = _copy_tree(dest)
    where = subprocess.run([sys.executable, "-c", "import tierguard; print(tierguard.__file__)"],
                           cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=60)
    assert Path(where.stdout.strip()).is_relative_to(copy), where.stdout + where.stderr
    res = _pytest(copy, [k for m in mutants for k in m.killers])
    assert res.returncode == 0, "killing tests fail without a mutation:\n" + res.stdout[-3000:] + res.stderr[-2000:]
    return copy


def _kill(mutant: Mutant, pristine: Path, dest: Path) -> None:
    copy = dest / "copy"
    shutil.copytree(pristine, copy, ignore=_IGNORE)
    target = copy / mutant.path
    text = target.read_text()
    assert text.count(mutant.old) == 1, f"stale mutant {mutant.name!r}: its text occurs {text.count(mutant.old)} times"
    target.write_text(text.replace(mutant.old, mutant.new))
    res = _pytest(copy, list(mutant.killers))
    out = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 1, f"mutant {mutant.name!r} survived (pytest exit {res.returncode}):\n{out}"
    assert any(f"FAILED {k}" in res.stdout for k in mutant.killers), out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _pristine(tmp_path_factory.mktemp("pristine"), FAST)


@pytest.fixture(scope="module")
def pristine_slow(tmp_path_factory) -> Path:
    return _pristine(tmp_path_factory.mktemp("pristine-slow"), SLOW)


@pytest.mark.parametrize("mutant", FAST, ids=[m.path.split("/")[-1] for m in FAST])
def test_mutant_is_killed(mutant: Mutant, pristine: Path, tmp_path: Path):
    _kill(mutant, pristine, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", SLOW, ids=[m.path.split("/")[-1] for m in SLOW])
def test_slow_mutant_is_killed(mutant: Mutant, pristine_slow: Path, tmp_path: Path):
    _kill(mutant, pristine_slow, tmp_path)
