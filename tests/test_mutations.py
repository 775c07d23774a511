"""Mutation check: each headline claim has a default test that fails when the code breaks it.

A mutant is one exact text replacement in the package, plus the default tests that must
kill it. It names its file by globs (`tierguard/model/**/*.c`), and its text must occur
exactly once across all the files they match, so a mutant that no longer matches the code
(the code moved on) fails loudly instead of passing silently, while a function that
moves to another file under the same globs keeps its mutant. Every mutant's text, the
slow ones' included, is checked against the code in the default suite.

How a mutant is run: the package, the tests and pyproject.toml are copied to a temp dir,
the replacement is made in the copy, and the killing tests run in a subprocess with the
copy as working directory and first on PYTHONPATH, so the test process and every child it
starts (servers, CLIs) import the mutated copy (a C mutant builds its own kernel library,
keyed by the mutated source). With -x, the run must end in failed tests (pytest exit code
1) with a FAILED line for a killing test, not in a collection or usage error (a renamed
test is reported as such); `because`, when set, is text the failure must show (the
assertion that was meant to catch it). First the same tests must pass on an unmutated
copy, or a mutant's "kill" would mean nothing.

Adding a mutant is one entry in MUTANTS. A `slow=True` mutant runs with `make test`
(`-m slow`), not in the default suite: one beyond the headline claims (each mutant costs a
process start and its killing tests, a few seconds of CPU; the default list is the
headline claims).
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


# Where C kernels and engine policies live: a mutant names a glob, not a file, so moving a
# function between files (a kernel family to its own file, a policy to its own module)
# does not stale it; its text must still occur exactly once across all the glob's files.
C_KERNELS = ("tierguard/model/**/*.c", "tierguard/model/**/*.h", "tierguard/model/**/*.inc")
ENGINE = ("tierguard/engine/**/*.py",)


@dataclass(frozen=True)
class Mutant:
    name: str
    where: str | tuple[str, ...]  # globs relative to the repository root (a plain path is one)
    old: str  # exact text, present exactly once across the files the globs match
    new: str
    killers: tuple[str, ...]  # pytest node ids of default tests; the run of them must fail
    slow: bool = False
    because: str = ""  # text the killing run's output must show (the assertion that caught it)

    @property
    def globs(self) -> tuple[str, ...]:
        return (self.where,) if isinstance(self.where, str) else self.where


# Prefixes staged from disk after a restart, watched by tests/engine/guard_spy.py.
TIERS_RESTART = "tests/engine/test_tiers.py::test_prefix_reload_from_disk_after_restart"
# Greedy tokens and logits against transformers. The tiny Llama's steps (chunked prefill
# beside decodes, at most 64 rows) all run the fused C step; Qwen3's q/k norm keeps it on
# the per-op Python layers (as a long prefill chunk of any model is).
HF_PARITY = "tests/engine/test_hf_parity.py::test_batched_chunked_prefill_and_prefix_hits"
HF_PARITY_PER_OP = "tests/engine/test_hf_parity.py::test_parity_variants[qwen3]"
REMOTE_GUARD = "tests/engine/test_remote_tier_engine.py::test_a_prefix_written_by_one_engine_is_loaded_by_another"
VLLM_LOGIC = "tests/integrations/test_vllm_connector_logic.py"
PREDICTED = "tests/gate/test_predicted_admission.py::"  # predicted-TTFT admission on a pinned clock
GATE = ("tierguard/gate/**/*.py",)

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
        "goodput: a quantized setting counts below its quality bar",
        "bench/goodput.py",
        "    return agree is not None and agree >= need",
        "    return True",
        ("tests/bench/test_goodput.py::test_a_quantized_setting_below_its_quality_bar_counts_nowhere",),
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
        ENGINE,
        "from tierguard.kv.guard import decode_guard",
        "from contextlib import nullcontext as decode_guard",
        (TIERS_RESTART,),
    ),
    Mutant(
        "engine: the model run outside the decode guard",
        ENGINE,
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
        because="assert not shares_a_run(",  # the plaintext check, not the file's length
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
        "model: rope in Python rotates the wrong way (greedy parity with transformers breaks)",
        "tierguard/model/**/*.py",
        "return torch.addcmul(x * cos, swapped, sin_signed)",
        "return torch.addcmul(x * cos, swapped, -sin_signed)",
        (HF_PARITY_PER_OP,),
    ),
    Mutant(
        "model: rope in the fused C step rotates the wrong way",
        C_KERNELS,
        "t[d] = v[d] * cos[d] + v[d + half] * sin[d];",
        "t[d] = v[d] * cos[d] - v[d + half] * sin[d];",
        (HF_PARITY,),
    ),
    Mutant(
        "step budget: SLO admission ignored (a new sequence always starts)",
        ENGINE,
        "if self.slo_ms <= 0 or num_running == 0:\n            return True",
        "if True:\n            return True",
        ("tests/engine/test_decode_speed_paths.py::test_itl_slo_holds_new_requests_in_the_queue",),
    ),
    Mutant(
        "scheduler: a wave member never holds its last prompt token",
        ENGINE,
        "if members > 1 or self._joinable(budget, members, queued):",
        "if False:",
        ("tests/engine/test_decode_speed_paths.py::"
         "test_under_a_tight_slo_a_wave_prefills_together_and_starts_decoding_in_one_step",),
    ),
    Mutant(
        "contract: a ready interactive prefill never waits for a companion loading from a tier",
        ENGINE,
        "self.contract.goes_first(seq.request_class) and seq.num_holds < HOLD_STEPS and not self._overdue(seq)",
        "False",
        ("tests/engine/test_tiers_shared_prefill.py::"
         "test_a_ready_chat_waits_for_one_loading_from_host_and_they_prefill_in_one_step",),
    ),
    Mutant(
        "scheduler: a sequence set aside for a companion leaves its device prefix unpinned",
        ENGINE,
        "self._pins[seq.seq_id] = self.bm.pin(match)",
        "pass",
        ("tests/engine/test_tiers_shared_prefill.py::test_a_held_chat_keeps_its_device_prefix_while_the_other_loads",),
        slow=True,  # the killing test is a default test; the mutant costs a process start
    ),
    Mutant(
        "fused step: a prefill chunk's K/V not all stored before its rows attend (`ordered` dropped)",
        C_KERNELS,
        "if (s->ordered) {",
        "if (0) {",
        ("tests/engine/test_fused_decode.py::test_a_chunks_rows_see_each_other_in_any_order",),
    ),
    Mutant(
        "quantize: an int4 layer built as int8 (int4 runs the int8 path)",
        "tierguard/model/**/*.py",
        'if head or (self.weight_dtype == "int4" and not Int4Linear.supports(shape, self.group)):',
        "if True:",
        ("tests/engine/test_decode_speed_paths.py::test_quantized_engine_generates_close_to_float[int4]",),
    ),
    Mutant(
        "qlinear: an int4 layer's few rows run the dequantized path, not the packed kernel",
        "tierguard/model/**/*.py",
        "return native.gemv_int4(x, self.qweight, self.scale, self.lo, self.group)",
        "return self._blocked(x, self._dequant_native)",
        ("tests/model/test_qlinear.py::test_few_rows_run_the_packed_kernel_never_a_float_weight[int4]",),
    ),
    Mutant(
        "shared limits: slots counted per gate instead of fleet-wide",
        "tierguard/gate/**/*.py",
        '("slots", "long", "q:0",',
        '(f"slots:{self.gate_id}", f"long:{self.gate_id}", "q:0",',
        ("tests/gate/test_shared_limits.py::test_two_gates_never_run_more_than_the_shared_limit",),
    ),
    Mutant(
        "remote tier: a lookup asks Redis on the engine thread",
        "tierguard/kv/**/*.py",
        "        return self.index.contains(block_hash)",
        "        return bool(self._call(lambda: self.client.exists(self.key(block_hash)))[1])",
        (REMOTE_GUARD,),
        because="on the engine thread",
    ),
    Mutant(
        "gate: the byte rule disabled (every request counted exactly)",
        "tierguard/gate/**/*.py",
        "if bound is not None and bound < limit:",
        "if False:",
        ("tests/gate/test_token_bound.py::test_local_byte_level_bound_holds_and_skips_counting",),
    ),
    Mutant(
        "pool: blocks out of a sliding window are never freed",
        "tierguard/engine/block_manager.py",
        "        if self.num_groups == 1 or not seq.block_table:\n            return 0",
        "        if True:\n            return 0",
        ("tests/engine/test_gemma3_window.py::test_sliding_groups_hold_only_the_window",),
    ),
    Mutant(
        "gemma3: sliding layers attend beyond their window",
        "tierguard/engine/group_metadata.py",
        "    if window is not None:\n        mask &= keys > queries - window",
        "    if False:\n        mask &= keys > queries - window",
        ("tests/engine/test_gemma3_window.py::test_greedy_and_logits_match_transformers_past_the_window",),
        slow=True,  # transformers' import and forward
    ),
    Mutant(
        "vLLM connector: a load past its class deadline keeps the request waiting",
        "tierguard/integrations/vllm/scheduler.py",
        'if load.state == "staging" and now > load.deadline:',
        "if False:",
        (f"{VLLM_LOGIC}::test_a_stalled_disk_read_is_given_back_at_the_interactive_deadline",),
    ),
    Mutant(
        "vLLM connector: cold blocks staged on the calling (forward) thread",
        "tierguard/integrations/vllm/scheduler.py",
        "self._submit(spec, lambda r, load=load, blocks=blocks: self._on_staged(load, blocks, r))",
        'self._on_staged(load, blocks, TransferResult(0, True, self.worker._handlers[spec.route].run(spec, None), 0, ""))',
        ("tests/integrations/test_vllm_connector_spy.py::test_no_medium_read_runs_on_the_forward_thread",),
    ),
    Mutant(
        "vLLM connector: a full store queue still queues the store",
        "tierguard/integrations/vllm/scheduler.py",
        "if self._queued_blocks + new > self.config.store_queue_blocks:",
        "if False:",
        (f"{VLLM_LOGIC}::test_a_full_store_queue_drops_the_store_and_never_waits",),
        slow=True,
    ),
    Mutant(
        "engine: a step's duration read from the wall clock (the simulator's decisions drift from the engine's)",
        "tierguard/engine/llm_engine.py",
        "duration_s=self.clock.monotonic() - started,",
        "duration_s=__import__('time').perf_counter() - started,",
        ("tests/predict/test_sim_equivalence.py::test_simulated_engine_decides_as_the_real_one[target-itl]",),
    ),
    Mutant(
        "predict: a naive repeat spill charged as a new file write (the naive p99 ITL doubles)",
        "tierguard/predict/simengine.py",
        'self.cost.route("naive_respill" if known else "naive_spill")',
        'self.cost.route("naive_spill")',
        ("tests/predict/test_noise_terms.py::test_naive_repeat_spill_of_a_block_on_disk_costs_the_measured_repeat",),
    ),
    Mutant(
        "predict: every token takes the median delivery (no delivery noise in the ITL p99)",
        "tierguard/predict/driver.py",
        "if rng is None or not self.deliver_samples_s:",
        "if True:",
        ("tests/predict/test_noise_terms.py::test_calibrated_delivery_noise_raises_the_itl_p99_and_keeps_its_median",),
    ),
    Mutant(
        "predict: the compute probe runs without the tiers (their write-behind's cost unseen)",
        "tierguard/predict/engines.py",
        'PROBE_DROP = ("--kv-cache-gib",',
        'PROBE_DROP = ("--kv-host-gib", "--kv-disk-dir", "--kv-disk-gib", "--kv-cache-gib",',
        ("tests/predict/test_calibration.py::test_the_compute_probe_drops_the_kv_budget_and_keeps_the_tiers",),
    ),
    Mutant(
        "tiers: an offload queued behind write-behind that waits for the stores' share",
        "tierguard/kv/transfer.py",
        "if store and holds_device:",
        "if False:",
        ("tests/kv/test_store_policy.py::test_an_offload_runs_while_write_behind_waits_for_the_share",),
    ),
    Mutant(
        "tiers: a finished sequence's offload sent to the write-behind lane",
        "tierguard/kv/tiered_connector.py",
        "holds_device=True)",
        "holds_device=False)",
        ("tests/engine/test_tiers.py::test_a_finished_sequence_leaves_the_device_while_write_behind_waits",),
    ),
    Mutant(
        "predict: successive simulated steps drawn independently (a slow run of steps averages away)",
        "tierguard/predict/simengine.py",
        "u=self.noise.next() if self.noise is not None else None)",
        "u=None)",
        ("tests/predict/test_noise_terms.py::test_step_noise_keeps_the_measured_correlation_of_successive_steps",),
    ),
    Mutant(
        "predict: every replica of a cell sends the first replica's prompts",
        "tierguard/predict/predictor.py",
        "repeat=r + k * REPLICA_STRIDE)",
        "repeat=r)",
        ("tests/predict/test_replicas.py::test_each_replica_sends_its_own_prompts_and_the_first_is_written",),
        slow=True,
    ),
    Mutant(
        "bf16 kernel: activations truncated to bfloat16, not rounded to nearest",
        C_KERNELS,
        "u += 0x7fffu + ((u >> 16) & 1u);",
        "u += 0u;",
        ("tests/model/test_bf16_kernels.py::test_gemm_bf16_matches_a_float64_reference",),
        slow=True,
    ),
    Mutant(
        "bf16 kernel, portable path: the odd inputs' products dropped",
        C_KERNELS,
        "acc[m] += xe * we + xo * wo;",
        "acc[m] += xe * we;",
        ("tests/model/test_bf16_kernels.py::test_fallback_builds_compute_the_same",),
        slow=True,
    ),
    Mutant(
        "predicted admission: the prediction is ignored (everything admitted)",
        GATE,
        "            if upper > slo:\n",
        "            if False:\n",
        (PREDICTED + "test_over_the_slo_is_429_with_retry_after_the_predicted_wait",),
    ),
    Mutant(
        "predicted admission: Retry-After is the whole predicted TTFT, not the predicted wait",
        GATE,
        "wait = max(0.0, booked - alone)",
        "wait = max(0.0, booked)",
        (PREDICTED + "test_over_the_slo_is_429_with_retry_after_the_predicted_wait",),
    ),
    Mutant(
        "predicted admission: a request that waited out its budget is overtaken",
        GATE,
        "return due + [e for e in waiting if e.due_at > now]",
        "return waiting",
        (PREDICTED + "test_a_request_that_waited_its_budget_is_never_overtaken",),
    ),
    Mutant(
        "predicted admission: batch goes before interactive",
        GATE,
        'RANKS = {"interactive": 0, "batch": 1}',
        'RANKS = {"interactive": 1, "batch": 0}',
        (PREDICTED + "test_interactive_goes_before_batch",),
    ),
    Mutant(
        "predicted admission: a booked retry is priced as a new request",
        GATE,
        "if info.key is not None and not info.background and info.key in self.bookings:",
        "if False:",
        (PREDICTED + "test_a_rejected_client_that_retries_as_told_takes_its_place",),
    ),
    Mutant(
        "predicted admission: the online fit never learns",
        GATE,
        "        if not self.learn:\n            return r",
        "        if True:\n            return r",
        (PREDICTED + "test_the_fit_converges_to_a_known_cost_and_follows_it_when_it_changes",
         "tests/gate/test_predicted_gate.py::test_a_calibration_wrong_by_2x_is_corrected_online_and_its_error_shows"),
    ),
]
FAST = [m for m in MUTANTS if not m.slow]


def _id(m: Mutant) -> str:
    """A test id from the mutant's name: 'engine-a-step-never-enters-the-decode-guard'."""
    return re.sub(r"[^a-z0-9]+", "-", m.name.lower()).strip("-")[:60].rstrip("-")


SLOW = [m for m in MUTANTS if m.slow]


_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")  # no stale bytecode in a copy


def _copy_tree(dest: Path) -> Path:
    for name in ("tierguard", "tests", "bench"):
        shutil.copytree(ROOT / name, dest / name, ignore=_IGNORE)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _env(copy: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(copy) + (os.pathsep + path if path else "")}


def _pytest(copy: Path, node_ids: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-p", "no:cacheprovider", *node_ids],
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


def locate(mutant: Mutant, root: Path) -> Path:
    """The one file under `root` whose text holds the mutant's text, across all its globs;
    the text must occur exactly once in all those files together."""
    files = sorted({f for g in mutant.globs for f in root.glob(g) if f.is_file() and "__pycache__" not in f.parts})
    counts = {f: f.read_text(errors="replace").count(mutant.old) for f in files}
    total = sum(counts.values())
    assert total == 1, (
        f"stale mutant {mutant.name!r}: its text occurs {total} times in {len(files)} files matching {mutant.globs}"
        + "".join(f"\n  {f.relative_to(root)}: {n}" for f, n in counts.items() if n)
    )
    return next(f for f, n in counts.items() if n)


def _kill(mutant: Mutant, pristine: Path, dest: Path) -> None:
    copy = dest / "copy"
    shutil.copytree(pristine, copy, ignore=_IGNORE)
    target = locate(mutant, copy)
    target.write_text(target.read_text().replace(mutant.old, mutant.new))
    res = _pytest(copy, list(mutant.killers))
    out = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 1, f"mutant {mutant.name!r} survived (pytest exit {res.returncode}):\n{out}"
    assert any(f"FAILED {k}" in res.stdout for k in mutant.killers), out
    assert mutant.because in res.stdout, f"mutant {mutant.name!r} was killed, but not by {mutant.because!r}:\n{out}"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _pristine(tmp_path_factory.mktemp("pristine"), FAST)


@pytest.fixture(scope="module")
def pristine_slow(tmp_path_factory) -> Path:
    return _pristine(tmp_path_factory.mktemp("pristine-slow"), SLOW)


def test_every_mutant_matches_the_code_once_and_names_real_tests():
    """Cheap and in the default suite, for the slow mutants too: a stale text or a renamed
    killing test shows in `make check`, not only in the full `make test`."""
    for m in MUTANTS:
        locate(m, ROOT)
    killers = sorted({k for m in MUTANTS for k in m.killers})
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                          "no:cacheprovider", *killers], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    collected = {line.strip().split("[")[0] for line in res.stdout.splitlines()}  # a parametrized one: all
    collected |= {line.strip() for line in res.stdout.splitlines()}
    assert set(killers) <= collected, sorted(set(killers) - collected)


@pytest.mark.parametrize("mutant", FAST, ids=[_id(m) for m in FAST])
def test_mutant_is_killed(mutant: Mutant, pristine: Path, tmp_path: Path):
    _kill(mutant, pristine, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", SLOW, ids=[_id(m) for m in SLOW])
def test_slow_mutant_is_killed(mutant: Mutant, pristine_slow: Path, tmp_path: Path):
    _kill(mutant, pristine_slow, tmp_path)
