"""The synchronous engine: add_request / step / abort.

`step()` is poll the KV connector -> schedule -> run the model -> sample -> postprocess
(append tokens, detect stops, publish computed blocks to the prefix cache, free finished
sequences). It is not thread-safe; AsyncLLMEngine drives it from a single thread.

Failure isolation: what one request owns is done under its own guard: adding it (all or
nothing), sampling its row (the batch, then row by row when the batch raises),
publishing its blocks, detokenizing and its stop checks. When that raises, the request
alone ends with finish_reason "error" and a RequestFailed, its blocks freed, and the step
goes on for the others. What belongs to the whole batch (polling the connector,
scheduling, the model run) raises out of step(): the caller cannot tell whose it was.

Tiers reach the engine only through the KV connector (tierguard/kv/connector.py), built
here from the config and handed to the scheduler; `--kv-naive-sync-disk` selects the
benchmark's paging scheduler (naive_scheduler.py) instead of the production one.

Time comes from one `Clock` (tierguard/common/clock.py), read by the engine, the
scheduler, admission and the connector. What moves bytes or computes is built by three
methods apart from the policies: `_make_runner` (the model), `_make_tiers` (host RAM,
cold media and the transfer worker behind the connector) and `_naive_disk` (the naive
baseline's synchronous disk). The simulator (tierguard/predict) overrides exactly those
and the clock, so every decision it predicts is made by this code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tierguard.common.clock import SYSTEM_CLOCK, Clock
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.engine.admission import ContractAdmission, FifoAdmission
from tierguard.engine.api import (
    EngineStats,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StepShape,
    StepStats,
    Tokenizer,
)
from tierguard.engine.block_manager import BlockManager
from tierguard.engine.block_pool import BlockPool
from tierguard.engine.config import EngineConfig
from tierguard.engine.detokenizer import IncrementalDetokenizer
from tierguard.engine.model_runner import ModelRunner
from tierguard.engine.sampler import check_sampling, make_generator, sample
from tierguard.engine.scheduler import Scheduler
from tierguard.engine.sequence import FINISH_REASONS, ScheduledSeq, Sequence, SequenceStatus
from tierguard.kv.connector import KVConnector, NoConnector, TierOptions
from tierguard.kv.contract import ColdContract
from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import decode_guard
from tierguard.kv.spec import fingerprint, fingerprint_salt
from tierguard.kv.tiered_connector import TieredConnector
from tierguard.model.config import ModelConfig
from tierguard.model.llama import LlamaModel

if TYPE_CHECKING:
    from tierguard.baselines.naive_kv import NaiveSyncDisk

log = logging.getLogger(__name__)

# While a load or a transfer is the only work, a step sleeps this long instead of
# spinning (the engine never waits *for* a transfer; it just idles).
IDLE_SLEEP_S = 0.0005


class LLMEngine:
    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        model_name: str = "model",
        weights_id: str = "",
        faults: FaultInjector | None = None,  # tests: injected tier I/O failures and delays
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.clock = clock
        config.validate_tiers()
        self.runner = self._make_runner(model, dtype, device)
        # One fingerprint (model, config, weights id, KV layout incl. dtype, quantization and
        # block size) salts the prefix hashes and names the tiers' blocks.
        self.fingerprint = fingerprint(weights_id or model_name, self.runner.kv_layout, vars(model_config))
        self.pool = BlockPool(config.num_blocks, record_evictions=config.tiers_enabled)
        self.groups = self.runner.groups  # layer groups of the pool (tierguard/kv/groups.py)
        self.block_manager = BlockManager(
            self.pool,
            config.block_size,
            fingerprint_salt(self.fingerprint),
            config.enable_prefix_caching,
            groups=self.groups,
            max_chunk=config.max_num_batched_tokens,
        )
        self.contract: ColdContract | None = None  # the cold contract, when tiers are on
        self.connector = self._make_connector(faults)
        self.scheduler = self._make_scheduler()
        self.eos_ids = set(model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._listeners: list[Callable[[StepStats], None]] = []
        # Test hook: called with (request ids, float32 logits) for every sampled row.
        self.logits_hook: Callable[[list[str], torch.Tensor], None] | None = None
        self.step_count = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- requests -----------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise TierguardError naming the problem; touches no state."""
        n = len(prompt_token_ids)
        if n == 0:
            raise TierguardError("prompt is empty")
        if params.max_tokens < 1:
            raise TierguardError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if n + params.max_tokens > self.config.max_model_len:
            raise TierguardError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds the context limit of {self.config.max_model_len} tokens"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise TierguardError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        check_sampling(params, vocab)
        blocks = self.groups.sequence_blocks(
            n + params.max_tokens, self.config.max_num_batched_tokens, self.config.block_size
        )
        if blocks > self.config.num_blocks:
            raise TierguardError(
                f"request needs {blocks} KV blocks but the pool has {self.config.num_blocks}; raise the KV budget"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_class: str = "interactive",
        arrival: float | None = None,
    ) -> None:
        """Queue a request. All or nothing: when it raises, the engine holds nothing of it."""
        if request_id in self.seqs:
            raise TierguardError(f"request id {request_id!r} is already in flight")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, arrival or self.clock.monotonic(), request_class)
        seq.generator = make_generator(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        self.scheduler.add(seq)
        self.seqs[request_id], self._detok[request_id] = seq, detok

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.status = SequenceStatus.FINISHED_ABORTED
        return self._finish(seq, [])

    def _make_runner(self, model: LlamaModel, dtype: torch.dtype, device: torch.device) -> ModelRunner:
        """The model's compute over the device KV pool (mechanism)."""
        config = self.config
        return ModelRunner(
            model,
            self.model_config,
            config.num_blocks,
            config.block_size,
            dtype,
            device,
            kv_dtype=config.kv_dtype,
            decode_graph_max_batch=config.decode_graph_max_batch,
            max_blocks_per_seq=config.max_blocks_per_seq,
        )

    def _make_connector(self, faults: FaultInjector | None) -> KVConnector:
        config = self.config
        if not config.tiers_enabled:
            return NoConnector()
        options = TierOptions(
            int(config.kv_host_gib * GIB),
            config.media_options(),
            config.ttft_budget_ms,
            store_share=config.kv_store_share,
            store_max_pending=config.kv_store_max_pending,
        )
        if config.kv_encrypt_key_file:  # every cold medium stores blocks sealed (AES-256-GCM)
            from tierguard.kv.media.aead_codec import AesGcmCodec

            old = [config.kv_encrypt_old_key_file] if config.kv_encrypt_old_key_file else []
            options.codec = AesGcmCodec.from_files(config.kv_encrypt_key_file, old)
        self.contract = ColdContract(options.ttft_budget_ms)
        return self._make_tiers(options, self.contract, faults)

    def _make_tiers(self, options: TierOptions, contract: ColdContract, faults: FaultInjector | None) -> KVConnector:
        """The tiered connector over host RAM, the configured cold media and a transfer
        worker: the connector's decisions with the mechanism that moves the bytes."""
        return TieredConnector.create(
            self.pool, self.runner.device_pool, self.config.block_size, self.fingerprint, options, contract,
            faults, self.groups, self.clock,
        )

    def _naive_disk(self) -> NaiveSyncDisk | None:
        """The naive baseline's synchronous disk (mechanism); None: its real spill files."""
        return None

    def _make_scheduler(self) -> Scheduler:
        config, bm, clock = self.config, self.block_manager, self.clock
        if config.naive_sync_disk:  # benchmark only: the failure mode the contract prevents
            from tierguard.baselines.naive_scheduler import make_naive_scheduler

            if self.groups.hybrid:
                raise TierguardError(
                    "--kv-naive-sync-disk (a benchmark baseline) pages whole-layer blocks; "
                    "it does not run models with sliding-window layer groups"
                )
            return make_naive_scheduler(
                config, bm, self.connector, self.runner.device_pool, self.fingerprint, self._naive_disk(), clock
            )
        if self.contract is not None:
            return Scheduler(config, bm, self.connector, ContractAdmission(bm, self.contract, clock), clock=clock)
        return Scheduler(config, bm, self.connector, FifoAdmission(), clock=clock)

    @property
    def compute_path(self) -> str:
        """How steps are computed (the C decode path, or torch for models it does not cover)."""
        return self.runner.compute_path

    def describe_kv_groups(self) -> str:
        """The pool's layer groups in one line (one group unless some layers slide)."""
        groups = self.groups.groups
        if len(groups) == 1:
            return f"one group of {len(groups[0].layers)} layers, full attention"
        full = sum(not g.sliding for g in groups)
        windows = sorted({g.window for g in groups if g.sliding})
        return (
            f"{len(groups)} groups of {self.groups.width} layers: {full} full attention, "
            f"{len(groups) - full} sliding window {'/'.join(map(str, windows))} (blocks out of the window are freed)"
        )

    def has_unfinished(self) -> bool:
        """Also True while tier transfers are in flight, so their completions are polled
        (a finished request's write-behind to disk is submitted from poll())."""
        return self.scheduler.has_work() or self.connector.busy()

    def close(self) -> None:
        """Finish in-flight tier writes (bounded) and stop the transfer workers."""
        self.connector.close()

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = self.clock.monotonic()
        # Never waits: finished transfers only; loads that arrived rejoin the queue.
        for seq in self.connector.poll().finished_loads:
            self.scheduler.requeue_front(seq)
        # The cold contract's enforcement: nothing below may read the disk tier.
        with decode_guard():
            sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        # Classified before postprocessing moves num_computed_tokens.
        prefills = [s for s in sched.scheduled if s.seq.is_prefill]
        shape = StepShape.of(sched.scheduled)
        if not sched.scheduled and self.connector.busy():
            self.clock.sleep(IDLE_SLEEP_S)  # only loads/transfers outstanding: idle, do not spin
        if sched.scheduled:
            with decode_guard():
                logits = self.runner.run(sched.scheduled)
            sampling = [s.seq for s in sched.scheduled if s.samples]
            if self.logits_hook is not None and sampling:
                self.logits_hook([s.seq_id for s in sampling], logits)
            token_of, failed = self._sample(logits, sampling)
            for item in sched.scheduled:
                seq = item.seq
                if seq.seq_id in failed:
                    outputs.append(self._fail(seq, "sampling", failed[seq.seq_id]))
                    continue
                try:  # one sequence's own work: its failure is its request's alone
                    out = self._postprocess(item, token_of)
                except Exception as exc:
                    out = self._fail(seq, "postprocessing", exc)
                if out is not None:
                    outputs.append(out)
        self.step_count += 1
        stats = StepStats(
            step=self.step_count,
            started_at=started,
            duration_s=self.clock.monotonic() - started,
            num_prefill_seqs=len(prefills),
            num_prefill_tokens=sum(s.num_tokens for s in prefills),
            num_decode_seqs=len(sched.scheduled) - len(prefills),
            num_preempted=len(sched.preempted),
            shape=shape,
        )
        if sched.scheduled:  # the step budget learns decode and prefill costs from real steps,
            # by row shape: a one-token row (a decode, a wave's last prompt token) costs a decode.
            chunks = [s.num_tokens for s in sched.scheduled if s.num_tokens > 1]
            self.scheduler.step_budget.observe(len(sched.scheduled) - len(chunks), sum(chunks), stats.duration_s)
        # An idle poll while only tier transfers are in flight is not a step worth a sample.
        idle_poll = self.config.tiers_enabled and not sched.scheduled and not sched.preempted
        for fn in [] if idle_poll else self._listeners:
            fn(stats)
        return outputs

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[dict[str, int], dict[str, Exception]]:
        """Tokens by sequence id, and the sequences whose sampling raised.

        One batch first; if it raises, row by row (the sampler has drawn nothing from a
        seeded row's generator then, sampler.py), so only the rows that raise alone fail.
        When every row of a batch of several raises alone too, the failure is not any
        one request's: it is raised (the engine stops)."""
        params, gens = [s.params for s in seqs], [s.generator for s in seqs]
        try:
            tokens = sample(logits, params, gens)
            return dict(zip((s.seq_id for s in seqs), tokens, strict=True)), {}
        except Exception as batch_error:
            token_of: dict[str, int] = {}
            failed: dict[str, Exception] = {}
            for i, seq in enumerate(seqs):
                try:
                    token_of[seq.seq_id] = sample(logits[i : i + 1], params[i : i + 1], gens[i : i + 1])[0]
                except Exception as exc:
                    failed[seq.seq_id] = exc
            if len(seqs) > 1 and not token_of:
                raise batch_error
            return token_of, failed

    def _postprocess(self, item: ScheduledSeq, token_of: dict[str, int]) -> RequestOutput | None:
        """One sequence after the model ran: its computed blocks, then its sampled token."""
        seq = item.seq
        seq.num_computed_tokens += item.num_tokens
        self.block_manager.register_computed(seq)
        if not item.samples:
            return None
        if seq.num_output_tokens == 0:
            self.prompt_tokens_total += seq.num_prompt_tokens
        return self._on_token(seq, token_of[seq.seq_id])

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> RequestOutput:
        """Abort one request whose own work raised; the rest of the step goes on."""
        log.error("request %s failed in %s and was aborted; the engine serves the others on",
                  seq.seq_id, stage, exc_info=exc)
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._drop(seq)
        out = self._output(seq, [], "")
        out.finish_reason = "error"
        out.error = RequestFailed(f"the engine failed on this request ({stage}: {type(exc).__name__}: {exc})")
        return out

    def _on_token(self, seq: Sequence, token: int) -> RequestOutput | None:
        seq.append_token(token)
        self.generation_tokens_total += 1
        p = seq.params
        detok = self._detok[seq.seq_id]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif detok.add(token):
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH
        if seq.status.finished:
            return self._finish(seq, [token])
        text = detok.take(False)
        seq.text_held = not text
        return self._output(seq, [token], text)

    def _finish(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        text = self._detok[seq.seq_id].take(True)  # before anything is freed: it may raise
        self._drop(seq)
        return self._output(seq, new_tokens, text)

    def _drop(self, seq: Sequence) -> None:
        """Free what the engine holds of a finished sequence (idempotent in the pool)."""
        self.scheduler.remove(seq)
        self.runner.release(seq.seq_id)
        self._detok.pop(seq.seq_id, None)
        self.seqs.pop(seq.seq_id, None)

    def _output(self, seq: Sequence, new_tokens: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=new_tokens,
            text_delta=text,
            finished=seq.status.finished,
            finish_reason=FINISH_REASONS.get(seq.status),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- observation ------------------------------------------------------------------------
    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    def stats(self, max_age_s: float = 0.0) -> EngineStats:
        """A snapshot. Tier percentiles sort latency windows; a caller that asks after every
        step (the async engine) accepts tier values up to `max_age_s` old."""
        tiers = self.connector.stats(max_age_s)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=self.pool.num_used,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            kv_blocks_cached=self.pool.num_cached_free,
            kv_block_evictions=self.pool.num_evictions,
            kv_block_size=self.config.block_size,
            extra=self.runner.extra_stats(),  # KV bytes/token, weight offload gauges
            tiers=tiers,
            policy=self.scheduler.stats(),
            histograms=tiers.latency if tiers is not None else {},
        )

    def check_integrity(self) -> None:
        """Pool invariants, plus: every block referenced by a live sequence is counted."""
        self.block_manager.check_integrity()
        self.scheduler.check_integrity()
        refs: dict[int, int] = {}
        for seq in self.scheduler.running:
            for b in self.block_manager.held_blocks(seq):
                refs[b] = refs.get(b, 0) + 1
        for b, n in self.connector.held_refs().items():  # loads and in-flight transfers
            refs[b] = refs.get(b, 0) + n
        for b, r in enumerate(self.pool.ref_counts):
            if r != refs.get(b, 0):
                raise RuntimeError(f"block {b}: ref count {r} but {refs.get(b, 0)} owners")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Convenience for scripts and tests: run prompts to completion, return output ids."""
        ids = [f"gen-{self.step_count}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.error is not None:
                    raise out.error
                results[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
        return [results[rid] for rid in ids]

