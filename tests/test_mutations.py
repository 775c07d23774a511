"""Mutation check: each headline claim has a default test that fails when the code breaks it
(the rule: tests/README.md).

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
VLLM_QUEUE = "tests/integrations/test_vllm_connector_queue.py"
AT_REST_BINDING = "tests/kv/test_kv_at_rest_binding.py"
RECOMMEND_RANGES = "tests/report/test_recommend_ranges.py::test_every_sentence_claims_an_order_only_where_the_ranges_are_apart"
ENGINE_FAILURES = "tests/engine/test_async_engine.py"  # faults injected into one request, or the step
SERVE_FAILURES = "tests/serve/test_engine_failures.py"
CLUSTER_FAILOVER = ("tests/gate/test_shared_limits_cluster.py::"
                    "test_a_failover_seen_through_a_redirect_holds_shared_admission_until_every_lease_is_back")
# KV served only to the model and tenant it belongs to.
FINE_TUNE = "tests/engine/test_kv_identity_engine.py::test_a_fine_tune_in_the_same_directory_gets_no_kv_from_disk_or_redis"
TENANTS = "tests/gate/test_tenant_isolation.py::test_two_keys_share_no_prefix_and_no_response_tells"
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
        "        key = self.key(block_hash)\n"
        "        return bool(self._call(self.nodes.node_of(key), lambda: self.client.exists(key))[1])",
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
        ("tests/model/test_bf16_kernels.py::test_gemm_bf16_rounds_the_activations_to_nearest_even",
         "tests/model/test_bf16_kernels.py::test_gemm_bf16_matches_a_float64_reference"),
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
        "gate jobs: an exception in one async job kills its worker",
        "tierguard/gate/runner.py",
        "except Exception as exc:  # one job's failure, whatever it is, is that job's only",
        "except ValueError as exc:  # one job's failure, whatever it is, is that job's only",
        ("tests/gate/test_job_disk_full.py::test_workers_survive_jobs_that_fail_and_the_next_job_completes",),
        because="every async worker died",
    ),
    Mutant(
        "gate jobs: a full disk at submission is a 500",
        "tierguard/gate/proxy.py",
        "    except OSError as exc:\n        if exc.errno in DISK_FULL:",
        "    except ZeroDivisionError as exc:\n        if exc.errno in DISK_FULL:",
        ("tests/gate/test_job_disk_full.py::test_a_full_disk_answers_507_and_is_counted",),
    ),
    Mutant(
        "gate jobs: no per-key quota on pending jobs",
        "tierguard/gate/job_quota.py",
        "if n_mine >= lim.max_pending_per_key:",
        "if False:",
        ("tests/gate/test_job_limits.py::test_pending_quota_per_key_and_in_total",),
    ),
    Mutant(
        "gate jobs: job files written on the event loop",
        "tierguard/gate/runner.py",
        "asyncio.ensure_future(asyncio.to_thread(self.store.create, route, body, input_tokens, owner))",
        "asyncio.ensure_future(asyncio.sleep(0, self.store.create(route, body, input_tokens, owner)))",
        ("tests/gate/test_job_limits.py::test_job_files_are_written_off_the_event_loop_which_stays_responsive",),
    ),
    Mutant(
        "redis: a password in a URL is shown as it is",
        "tierguard/common/redact.py",
        "        netloc = f\"{user.partition(':')[0]}:{MASK}@{host}\"",
        "        netloc = netloc",
        ("tests/kv/test_kv_remote_auth_tls.py::test_url_errors_never_show_the_password",
         "tests/gate/test_shared_state_auth_tls.py::test_shared_state_with_auth_and_tls_and_no_password_in_the_log"
         "[requirepass]"),
    ),
    Mutant(
        "redis: the gate's shared-state warnings carry the password",
        "tierguard/gate/leases.py",
        "self.url = redact_url(url)",
        "self.url = url",
        ("tests/gate/test_shared_state_auth_tls.py::test_shared_state_with_auth_and_tls_and_no_password_in_the_log"
         "[requirepass]",),
        slow=True,
    ),
    Mutant(
        "gate jobs: a short write leaves a truncated job file",
        "tierguard/gate/jobs.py",
        "        view = view[n:]",
        "        view = view[len(view):]",
        ("tests/gate/test_job_limits.py::test_a_short_write_is_continued_until_the_whole_file_is_out",),
        slow=True,
    ),
    Mutant(
        "gate: deeply nested JSON is a 500",
        "tierguard/gate/http.py",
        "    except RecursionError:  # the parser's own depth guard",
        "    except ZeroDivisionError:  # the parser's own depth guard",
        ("tests/gate/test_gate_bad_input.py::test_deeply_nested_json_is_a_400_naming_it[estimate]",),
        slow=True,
    ),
    Mutant(
        "gate: chat messages that are not objects reach the token counter",
        "tierguard/gate/proxy.py",
        "problem = messages_problem(body.get(\"messages\")) if chat else None",
        "problem = None",
        ("tests/gate/test_gate_bad_input.py::test_messages_that_are_not_message_objects_are_a_400[local_tokenizer]",),
        slow=True,
    ),
    Mutant(
        "gate: an API key file others can read is accepted",
        "tierguard/common/crypto.py",
        "        if st.st_mode & 0o077:",
        "        if False:",
        ("tests/gate/test_gate_bad_input.py::test_an_api_key_file_others_can_read_is_refused_like_the_encryption_key",),
        slow=True,
    ),
    Mutant(
        "connector config: nan and inf accepted",
        "tierguard/integrations/vllm/config.py",
        "    if not math.isfinite(number):",
        "    if False:",
        ("tests/integrations/test_connector_config_bounds.py::test_nan_and_inf_are_refused_by_name",),
        slow=True,
    ),
    Mutant(
        "sweep: a non-UTF-8 matrix file is a traceback",
        "tierguard/sweep/matrix.py",
        "        data = yaml.safe_load(read_matrix_text(p))",
        "        data = yaml.safe_load(p.read_bytes().decode())",
        ("tests/sweep/test_matrix_encoding.py::test_a_non_utf8_file_is_one_line_and_exit_2",),
        slow=True,
    ),
    # ---- claims of the KV at rest, the vLLM connector, the store policy, the recommendation,
    # shared limits, the bench, kv purge and Retry-After (tests/README.md: the rule) ----
    Mutant(
        "at rest: every block the tiers seal gets the same nonce",
        "tierguard/common/crypto.py",
        "nonce = os.urandom(NONCE_BYTES)\n        out[:HEADER_BYTES]",
        "nonce = bytes(NONCE_BYTES)\n        out[:HEADER_BYTES]",
        (f"{AT_REST_BINDING}::test_every_block_the_codec_seals_gets_a_fresh_nonce",),
    ),
    Mutant(
        "at rest: the associated data leaves out the model fingerprint",
        "tierguard/kv/media/block_format.py",
        'return fingerprint.encode("ascii") + block_hash.to_bytes(HASH_BYTES, "little")',
        'return block_hash.to_bytes(HASH_BYTES, "little")',
        (f"{AT_REST_BINDING}::test_the_same_hash_under_another_fingerprint_fails_authentication",),
    ),
    Mutant(
        "vLLM connector: a failed device copy is not reported as load errors",
        "tierguard/integrations/vllm/worker.py",
        "errors += [b for b, ok in zip(job.block_ids, done.block_ok, strict=True) if not ok]",
        "errors += []",
        (f"{VLLM_QUEUE}::test_a_failed_device_copy_is_reported_as_load_errors",),
    ),
    Mutant(
        "vLLM connector: a load abandoned at twice its class deadline",
        "tierguard/integrations/vllm/scheduler.py",
        "now, now + self.config.load_deadline_ms[cls] / 1000.0",
        "now, now + self.config.load_deadline_ms[cls] / 500.0",
        (f"{VLLM_LOGIC}::test_a_stalled_disk_read_is_given_back_at_the_interactive_deadline",),
    ),
    Mutant(
        "vLLM connector: the store queue never drains as stores complete",
        "tierguard/integrations/vllm/scheduler.py",
        "self._queued_blocks -= len(store.plan.to_store)",
        "self._queued_blocks -= 0",
        (f"{VLLM_QUEUE}::test_the_store_queue_drains_as_stores_complete[host]",),
    ),
    Mutant(
        "vLLM connector (connector.py): load errors never handed to vLLM",
        "tierguard/integrations/vllm/connector.py",
        "return self.worker.load_errors() if self.worker is not None else set()",
        "return set()",
        ("tests/integrations/test_vllm_connector_module.py::"
         "test_a_failed_copy_into_the_kv_cache_comes_back_as_load_errors",),
    ),
    Mutant(
        "store policy: idle time banks without bound",
        "tierguard/kv/store_policy.py",
        "self._tokens = min(self.burst_s, self._tokens + max(0.0, now - self._refilled) * self.share)",
        "self._tokens = self._tokens + max(0.0, now - self._refilled) * self.share",
        ("tests/kv/test_store_policy_burst.py::test_idle_time_banks_at_most_the_burst",),
    ),
    Mutant(
        "recommendation: long sessions called worse on points, not ranges",
        "tierguard/report/recommend.py",
        'if ml is None or relation(ml, ms) == "below":',
        "if ml is None or ml.best < ms.best:",
        (RECOMMEND_RANGES,),
    ),
    Mutant(
        "recommendation: the RAM tier called below the reference on points, not ranges",
        "tierguard/report/recommend.py",
        'if relation(mh, mr) == "below":',
        "if mh.best < mr.best:",
        (RECOMMEND_RANGES,),
    ),
    Mutant(
        "shared limits: the long-session limit counted per gate",
        "tierguard/gate/**/*.py",
        '("slots", "long", "q:0",',
        '("slots", f"long:{self.gate_id}", "q:0",',
        ("tests/gate/test_shared_long_limit.py::"
         "test_a_long_request_on_one_gate_waits_for_the_long_slot_another_gate_holds",),
    ),
    Mutant(
        "bench: TTFT timed from the concurrency slot, not the schedule (coordinated omission)",
        "tierguard/bench/worker.py",
        "rec.slot_s = mono() - t0",
        "rec.slot_s = rec.scheduled_s = mono() - t0",
        ("tests/bench/test_coordinated_omission.py::test_ttft_counts_the_wait_for_a_slot_from_the_scheduled_send_time",),
    ),
    Mutant(
        "kv purge: a live writer's temporary file removed",
        "tierguard/kv/media/disk/purge.py",
        "                if free:\n",
        "                if True:\n",
        ("tests/kv/test_kv_purge_live_writer.py::test_purge_leaves_a_live_writers_temporary_file_and_removes_a_dead_ones",
         "tests/kv/test_kv_disk_ownership.py::test_a_live_servers_temporary_files_are_found_by_lock_not_name"),
    ),
    Mutant(
        "gate: Retry-After a constant, not an estimate of the wait",
        "tierguard/gate/admission.py",
        "return int(min(60, max(1, math.ceil(self._service_ewma_s * ahead / slots))))",
        "return 1",
        ("tests/gate/test_retry_after.py::test_retry_after_tracks_the_time_the_queue_ahead_takes",),
    ),
    Mutant(
        "gate: Retry-After never learns the service time",
        "tierguard/gate/admission.py",
        "self._service_ewma_s += 0.1 * (held - self._service_ewma_s)",
        "pass",
        ("tests/gate/test_retry_after.py::test_retry_after_follows_a_change_in_service_time",),
    ),
    # beyond the headline claims (make test): breaks the mended tests now catch
    Mutant(
        "sweep: a stream that failed after its first token read as a success",
        "tierguard/sweep/results.py",
        "if not r.ok or r.ttft_ms is None:",
        "if r.ttft_ms is None:",
        ("tests/sweep/test_runner.py::test_failures_count_as_slo_misses",),
        slow=True,
    ),
    Mutant(
        "sweep: a request's ITL read as its mean gap (a few streams' stall averaged away)",
        "tierguard/sweep/results.py",
        "ok=True, ttft_ms=r.ttft_ms, itl_ms=itl.tolist(),",
        "ok=True, ttft_ms=r.ttft_ms, itl_ms=[tpot],",
        ("tests/sweep/test_request_mix.py::test_a_long_gap_in_a_quarter_of_the_streams_sets_the_p99_itl",),
        slow=True,
    ),
    Mutant(
        "bench: p99 TTFT incl. failed leaves the failures out",
        "tierguard/bench/stats.py",
        "all_ttft = [r.ttft_ms if r.ok else math.inf for r in measured if r.status != CANCELLED]",
        "all_ttft = [r.ttft_ms for r in measured if r.ok]",
        ("tests/bench/test_summary_tails.py::test_under_one_percent_failures_the_tail_still_counts_them",),
        slow=True,
    ),
    Mutant(
        "predict: simulated write-behind never waits for the stores' share",
        "tierguard/predict/simengine.py",
        "while not self.store_policy.allow_run(start):",
        "while False:",
        ("tests/predict/test_sim_transfer_lanes.py::test_write_behind_waits_for_the_share_and_promotions_do_not",),
        slow=True,
    ),
    Mutant(
        "bf16 kernel: activations rounded half up, not half to even",
        C_KERNELS,
        "u += 0x7fffu + ((u >> 16) & 1u);",
        "u += 0x8000u;",
        ("tests/model/test_bf16_kernels.py::test_gemm_bf16_rounds_the_activations_to_nearest_even",),
        slow=True,
    ),
    Mutant(
        "engine: a sampling failure on one request's row stops the engine",
        ENGINE,
        "if len(seqs) > 1 and not token_of:",
        "if True:",
        (f"{ENGINE_FAILURES}::test_a_request_whose_sampling_raises_fails_alone",),
    ),
    Mutant(
        "engine: a failure in one request's postprocessing stops the engine",
        ENGINE,
        'out = self._fail(seq, "postprocessing", exc)',
        "raise",
        (f"{ENGINE_FAILURES}::test_a_request_whose_detokenizing_raises_fails_alone",),
        slow=True,
    ),
    Mutant(
        "async engine: an exception while adding one request stops the engine",
        ENGINE,
        "except Exception as exc:  # adding this one request failed; it left nothing behind",
        "except ZeroDivisionError as exc:",
        (f"{ENGINE_FAILURES}::test_adding_a_request_that_raises_fails_alone",),
    ),
    Mutant(
        "async engine: a stopping engine leaves the requests in its command queue unanswered",
        ENGINE,
        "consumers = list(self._queues)",
        "consumers = list(self.engine.seqs)",
        (f"{ENGINE_FAILURES}::test_a_step_failure_stops_the_engine_and_answers_every_request",),
        slow=True,  # killed by its hang guard (15 s)
    ),
    Mutant(
        "serve: /health ignores a stopped engine",
        "tierguard/serve/app.py",
        "why = engine.failure()",
        "why = None",
        (f"{SERVE_FAILURES}::test_a_stopped_engine_is_503_before_any_work",),
    ),
    Mutant(
        "serve: seed not range-checked at the API",
        "tierguard/serve/protocol.py",
        "seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)",
        "seed: int | None = None",
        (f"{SERVE_FAILURES}::test_out_of_range_sampling_is_a_400_naming_the_field_and_the_engine_serves_on",),
    ),
    Mutant(
        "serve: top_k not checked against the vocabulary",
        "tierguard/serve/protocol.py",
        "if self.top_k is not None and self.top_k > vocab_size:",
        "if False:",
        (f"{SERVE_FAILURES}::test_out_of_range_sampling_is_a_400_naming_the_field_and_the_engine_serves_on",),
    ),
    Mutant(
        "serve: any number of stop strings",
        "tierguard/serve/protocol.py",
        "if len(stops) > MAX_STOP_STRINGS:",
        "if False:",
        (f"{SERVE_FAILURES}::test_out_of_range_sampling_is_a_400_naming_the_field_and_the_engine_serves_on",),
        slow=True,
    ),
    Mutant(
        "sampler: a top_k beyond the vocabulary reaches torch unclamped",
        ENGINE,
        "top_k = [min(params[i].top_k or v, v) for i in random_rows]",
        "top_k = [params[i].top_k or v for i in random_rows]",
        ("tests/engine/test_sampler.py::test_extreme_values_the_api_allows_sample_sanely",),
        slow=True,
    ),
    Mutant(
        "serve: a body's request_class overrides the class header",
        "tierguard/serve/protocol.py",
        "if any(headers.get(name) for name in (CLASS_HEADER, CLASS_HEADER_ALIAS)):",
        "if False:",
        (f"{SERVE_FAILURES}::test_the_class_header_wins_over_the_body",),
    ),
    Mutant(
        "gate: the class it admitted a request as is not sent upstream",
        "tierguard/gate/proxy.py",
        "upstream = await replica.upstream.post(route, payload, {PRIORITY_HEADER: priority})",
        "upstream = await replica.upstream.post(route, payload)",
        (f"{SERVE_FAILURES}::test_through_a_real_gate_the_gates_class_reaches_the_engine",),
        slow=True,
    ),
    Mutant(
        "gate: an answer marked engine-dead does not eject its replica",
        "tierguard/gate/proxy.py",
        'dead = upstream.headers.get(ENGINE_STATE_HEADER) == "dead"',
        "dead = False",
        ("tests/gate/test_dead_engine.py::test_a_request_that_meets_a_dead_engine_ejects_its_replica_at_once",),
    ),
    Mutant(
        "gate: the health probe takes any answer as alive",
        "tierguard/gate/upstreams.py",
        'return resp.status < 500, f"/health answered {resp.status}"',
        'return True, f"/health answered {resp.status}"',
        ("tests/gate/test_dead_engine.py::test_the_health_probe_ejects_a_replica_whose_engine_stopped",),
        slow=True,  # killed by its hang guard (15 s)
    ),
    Mutant(
        "serve: /detokenize decodes on the event loop",
        "tierguard/serve/app.py",
        "text = await state.decode(req.tokens)",
        "text = state.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)",
        (f"{SERVE_FAILURES}::test_detokenize_decodes_in_the_tokenizer_pool",),
        slow=True,
    ),
    Mutant(
        "remote tier on a cluster: one breaker for every node (a hung shard stops them all)",
        "tierguard/kv/**/*.py",
        "        breaker = self.breakers[node]\n",
        "        breaker = self.breakers[TOPOLOGY]\n",
        ("tests/kv/test_kv_remote_cluster.py::test_a_hung_master_costs_only_its_own_blocks",),
    ),
    Mutant(
        "shared limits on a cluster: lease keys without a hash tag (scripts span slots)",
        "tierguard/gate/**/*.py",
        'tag = "{" + prefix + "}"',
        "tag = prefix",
        ("tests/gate/test_shared_limits_cluster.py::test_a_fleets_keys_and_channel_share_one_slot",),
    ),
    Mutant(
        "shared limits: a failover seen through a redirect is not taken as an outage",
        "tierguard/gate/**/*.py",
        "if self.store.moves != self._moves_seen:",
        "if False:",
        (CLUSTER_FAILOVER,),
    ),
    Mutant(
        "shared limits: after an outage a gate counts on Redis before the others wrote their leases back",
        "tierguard/gate/**/*.py",
        "if self._down_since is not None and not self._settled():",
        "if False:",
        (CLUSTER_FAILOVER,),
        because="shared admission resumed before the other gates wrote their leases back",
    ),
    Mutant(
        "slab: only ftruncated (a sparse file: SIGBUS mid-run where /dev/shm is small)",
        "tierguard/integrations/vllm/shm.py",
        "os.posix_fallocate(fd, 0, size)",
        "os.ftruncate(fd, size)",
        ("tests/integrations/test_vllm_shm.py::test_a_slab_is_allocated_whole_at_start_not_sparse",),
    ),
    Mutant(
        "slab: a live lock holder's slab is reclaimed",
        "tierguard/kv/media/disk/owner.py",
        "yield try_lock(fd) and _same_file(fd, name, dir_fd)",
        "yield _same_file(fd, name, dir_fd)",
        ("tests/integrations/test_vllm_shm.py::test_a_live_owners_slab_is_never_removed_whatever_its_pid_says",),
    ),
    Mutant(
        "disk: a second server starts on a directory another live one holds",
        "tierguard/kv/media/disk/owner.py",
        "while not try_lock(fd):",
        "while False:",
        ("tests/kv/test_kv_disk_ownership.py::test_a_live_writers_directory_and_file_in_flight_are_never_touched",),
    ),
    Mutant(
        "disk: writes are never re-enabled after disk full",
        "tierguard/kv/media/disk/recovery.py",
        "self.writes_enabled = self.healthy = True",
        "pass",
        ("tests/kv/test_kv_disk_recovery.py::test_writes_resume_after_a_probe_succeeds_counted",),
    ),
    Mutant(
        "disk: old fingerprints' directories are not counted in the budget",
        "tierguard/kv/media/disk/tier.py",
        "self._used + self._old.bytes + self._reserved",
        "self._used + self._reserved",
        ("tests/kv/test_kv_disk_recovery.py::test_old_fingerprints_count_in_the_budget_and_go_oldest_first",),
    ),
    Mutant(
        "gate: an async job ignores the engine-dead mark",
        "tierguard/gate/forward.py",
        'if resp.headers.get(ENGINE_STATE_HEADER) == "dead":',
        "if False:",
        ("tests/gate/test_dead_engine.py::test_an_async_job_meeting_a_dead_engine_ejects_it_and_runs_elsewhere_as_batch",),
        slow=True,  # the request path's mark has a default mutant; this is its twin for jobs
    ),
    Mutant(
        "fingerprint: the weights' content left out (names only: a fine-tune reads the old KV)",
        "tierguard/engine/factory.py",
        'return f"sha256:{weights_digest(files)};',
        'return f"sha256:{[f.name for f in files]};',
        (FINE_TUNE,),
        because="assert tuned.fingerprint != old.fingerprint",
    ),
    Mutant(
        "weights digest cache: a file rewritten in place with its mtime set back keeps its old digest",
        "tierguard/kv/weights_digest.py",
        "return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]",
        "return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]",
        ("tests/kv/test_kv_identity.py::test_weights_digest_follows_content_not_size_or_mtime",),
    ),
    Mutant(
        "block hashes: the SHA-256 chain cut to 64 bits",
        "tierguard/engine/prefix_hash.py",
        'prev = int.from_bytes(sha(prev.to_bytes(HASH_BYTES, "little") + raw[off : off + step]).digest(), "little")',
        'prev = int.from_bytes(sha(prev.to_bytes(HASH_BYTES, "little") + raw[off : off + step]).digest()[:8], "little")',
        ("tests/kv/test_kv_identity.py::test_block_hashes_are_a_sha256_chain_rooted_in_the_fingerprint_and_the_salt",),
    ),
    Mutant(
        "cold tiers: a block made from other tokens served under the reader's name",
        "tierguard/kv/media/block_format.py",
        "return header.fingerprint == fingerprint and header.block_hash == block_hash",
        "return header.fingerprint == fingerprint",
        (
            "tests/kv/test_kv_identity.py::test_disk_a_block_from_other_tokens_under_the_readers_name_is_a_counted_miss",
            "tests/kv/test_kv_identity.py::test_redis_a_block_from_other_tokens_under_the_readers_key_is_a_counted_miss",
        ),
    ),
    Mutant(
        "engine: cache_salt not mixed into the first block's hash",
        ENGINE,
        "seq.hash_root = root_hash(self.fingerprint, seq.params.cache_salt)",
        "seq.hash_root = root_hash(self.fingerprint, None)",
        (
            "tests/engine/test_kv_identity_engine.py::test_cache_salt_partitions_the_prefix_cache_in_every_tier",
            "tests/serve/test_cache_salt_serve.py::test_cache_salt_partitions_the_prefix_cache",
        ),
    ),
    Mutant(
        "vLLM connector: cache_salt not mixed into the first block's hash",
        "tierguard/integrations/vllm/layout.py",
        "return root_hash(fingerprint_salt(fp), cache_salt)",
        "return root_hash(fingerprint_salt(fp), None)",
        ("tests/integrations/test_vllm_identity.py::test_request_hashes_are_rooted_in_the_fingerprint_and_the_cache_salt",),
    ),
    Mutant(
        "serve: cached_tokens reported without --enable-prompt-tokens-details",
        "tierguard/serve/generate.py",
        "out.num_cached_tokens if details else 0",
        "out.num_cached_tokens",
        ("tests/serve/test_cache_salt_serve.py::test_cached_tokens_only_with_the_flag",),
    ),
    Mutant(
        "gate: per-key isolation forwards no cache_salt (tenants share prefixes)",
        "tierguard/gate/isolation.py",
        "    body[SALT_FIELD] = salt\n",
        "    pass\n",
        (TENANTS,),
        because="hits_after == hits_before",
    ),
    Mutant(
        "gate: the route reason (prefix_hit) sent to clients without --route-headers",
        "tierguard/gate/proxy.py",
        "if len(fleet.replicas) > 1 and state.settings.route_headers:",
        "if len(fleet.replicas) > 1:",
        (TENANTS,),
        because="x-tierguard-r",
    ),
    Mutant(
        "gate: one prefix routing index for every salt (routing follows other keys' prefixes)",
        "tierguard/gate/prefix_index.py",
        'h = xxhash.xxh64_intdigest(salt.encode("utf-8", "surrogatepass"), seed=1) if salt else 0',
        "h = 0",
        ("tests/gate/test_tenant_isolation.py::test_per_key_salts_are_stable_unguessable_and_cannot_be_escaped",),
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
    Mutant(
        "percentile: the nearest rank above instead of interpolating as vllm bench serve",
        "tierguard/common/percentile.py",
        "    return low + frac * (high - low)\n",
        "    return high\n",
        ("tests/common/test_percentile.py::test_the_definition_is_vllm_bench_serves",),
    ),
    Mutant(
        "percentile: a bench script keeps a p99 of its own",
        "bench/tier_common.py",
        "pct = percentile  # q in 0..100, None for no values: the one definition (common/percentile.py)\n",
        "def pct(values, q):\n    s = sorted(values)\n    return s[min(len(s) - 1, int(q / 100 * len(s)))] if s else None\n",
        ("tests/common/test_percentile.py::test_no_other_percentile_implementation_exists",),
    ),
    Mutant(
        "bench: a run whose prompts were reused by the server's own counters still passes",
        "tierguard/bench/prefix_reuse.py",
        "    if hits > allowed:\n",
        "    if False:\n",
        ("tests/bench/test_prefix_reuse.py::test_levels_on_one_server_find_only_the_shared_prefix_and_a_replay_is_invalid",),
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
    """The copy first on PYTHONPATH, and CI unset: the run that starts this one has already
    checked the machine's needs (tests/needs.py), and a killing test that skips is not a
    kill anyway; the check would cost every mutant's process a torch import."""
    path = os.environ.get("PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    return {**env, "PYTHONPATH": str(copy) + (os.pathsep + path if path else "")}


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
