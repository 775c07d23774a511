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

Adding a mutant is one entry in MUTANTS. A `slow=True` mutant runs with `make test-all`
(`-m slow`), not in the default suite: one whose killers are expensive (they load
transformers), or one beyond the headline claims (each mutant costs a process start,
several seconds of CPU on this VM; the default list stays short).
"""

from __future__ import annotations

import os
import re
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


# Prefixes staged from disk after a restart, watched by tests/engine/guard_spy.py.
TIERS_RESTART = "tests/engine/test_tiers.py::test_prefix_reload_from_disk_after_restart"

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
        "engine: a step never enters the decode guard",
        "tierguard/engine/llm_engine.py",
        "from tierguard.kv.guard import decode_guard",
        "from contextlib import nullcontext as decode_guard",
        (TIERS_RESTART,),
    ),
    Mutant(
        "engine: the model run outside the decode guard",
        "tierguard/engine/llm_engine.py",
        "with decode_guard():\n                logits = self.runner.run(",
        "if True:\n                logits = self.runner.run(",
        (TIERS_RESTART,),
        slow=True,  # the default suite has the mutant above; this one shows the run's spy alone
    ),
    Mutant(
        "transfer: a staging read runs on the engine thread (the job runs where it is submitted)",
        "tierguard/kv/transfer.py",
        "self._executor.submit(self._run, job_id, spec, handler, prepared)",
        "self._run(job_id, spec, handler, prepared)",
        (TIERS_RESTART,),
    ),
    Mutant(
        "at rest: blocks written unencrypted",
        "tierguard/kv/media/aead_codec.py",
        "self.ring.seal_into(payload, aad, out)\n        return out",
        "return payload",
        ("tests/kv/test_kv_at_rest.py::test_blocks_are_sealed_no_plaintext_run_reaches_the_file",),
    ),
    Mutant(
        "at rest: a wrong key's write-behind overwrites the right key's block",
        "tierguard/kv/media/disk/tier.py",
        "if block_hash in self._undecodable:\n                self._c[\"rejected_writes\"] += 1",
        "if False:\n                self._c[\"rejected_writes\"] += 1",
        ("tests/kv/test_kv_at_rest.py::test_wrong_or_missing_key_is_a_counted_miss_that_never_overwrites",),
        slow=True,  # cheap, but every default mutant costs a process start; these have direct tests
    ),
    Mutant(
        "at rest: the TTL sweeper removes nothing",
        "tierguard/kv/media/disk/upkeep.py",
        "victims = [h for h, t in self._touched.items() if t < cutoff]",
        "victims = []",
        ("tests/kv/test_kv_at_rest.py::test_ttl_removes_blocks_not_used_for_that_long",),
        slow=True,
    ),
    Mutant(
        "model: keys rotated the wrong way (greedy parity with transformers breaks)",
        "tierguard/model/layers.py",
        "k * cos + _rotate_half(k) * sin",
        "k * cos - _rotate_half(k) * sin",
        ("tests/engine/test_hf_parity.py::test_parity_variants[qwen2]",),
        slow=True,  # ~12 s of CPU: transformers' import and forward
    ),
    Mutant(
        "engine: a step's duration read from the wall clock (the simulator's decisions drift from the engine's)",
        "tierguard/engine/llm_engine.py",
        "duration_s=self.clock.monotonic() - started,",
        "duration_s=__import__('time').perf_counter() - started,",
        ("tests/predict/test_sim_equivalence.py::test_simulated_engine_decides_as_the_real_one[target-itl]",),
    ),
]
FAST = [m for m in MUTANTS if not m.slow]


def _id(m: Mutant) -> str:
    """A test id from the mutant's name: 'engine-a-step-never-enters-the-decode-guard'."""
    return re.sub(r"[^a-z0-9]+", "-", m.name.lower()).strip("-")[:60].rstrip("-")


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


@pytest.mark.parametrize("mutant", FAST, ids=[_id(m) for m in FAST])
def test_mutant_is_killed(mutant: Mutant, pristine: Path, tmp_path: Path):
    _kill(mutant, pristine, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", SLOW, ids=[_id(m) for m in SLOW])
def test_slow_mutant_is_killed(mutant: Mutant, pristine_slow: Path, tmp_path: Path):
    _kill(mutant, pristine_slow, tmp_path)
