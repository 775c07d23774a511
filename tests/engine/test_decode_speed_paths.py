"""The speed paths compute what the plain path computes: the C decode kernel and the
static-buffer (CUDA graph) decode against the torch gather path; weight-only int8/int4
engines; the step budget that keeps prefill chunks from stretching decode steps."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, prompt_ids
from tests.engine.test_hf_parity import run_and_record
from tests.needs import skip_without_kernels
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.engine.step_budget import (
    SLO_MIN_TOKENS,
    SLO_REPROBE_STEPS,
    SLO_WAVE_SHARE,
    UNMEASURED_CHUNK,
    PrefillCost,
    StepBudget,
)
from tierguard.model import native

PROMPTS = [prompt_ids(40 + i, 5 + 6 * i) for i in range(3)] + [prompt_ids(50, 13)]


def _logits(engine, prompts=PROMPTS, max_tokens=12):
    outputs, logits = run_and_record(engine, prompts, max_tokens=max_tokens)
    return outputs, {rid: torch.stack(rows) for rid, rows in logits.items()}


def _assert_same(a, b, tol=1e-5):
    (out_a, lg_a), (out_b, lg_b) = a, b
    assert out_a == out_b
    for rid in lg_a:
        assert torch.allclose(lg_a[rid], lg_b[rid], atol=tol, rtol=tol), (
            rid,
            (lg_a[rid] - lg_b[rid]).abs().max(),
        )


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Decodes through gather + SDPA (the torch path)."""
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    engine.runner.native_decode = False
    return _logits(engine)


@skip_without_kernels()
def test_native_decode_matches_torch_path(tiny_dir, reference):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    assert engine.runner.native_decode
    _assert_same(_logits(engine), reference)


def test_static_decode_buffers_match_and_pad_into_scratch(tiny_dir, reference):
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, decode_graph_max_batch=8)
    runner = engine.runner
    runner.native_decode = False  # the graph path is the torch path on static buffers
    graphs = runner.decode_graphs
    assert graphs is not None and not graphs.capture  # eager on the CPU
    assert runner.kv_cache.shape[0] == engine.config.num_blocks + 1  # the scratch block
    _assert_same(_logits(engine), reference)
    # 4, 3, 2, 1 running sequences were padded up to buckets, and contexts crossed
    # block-count buckets (block size 4, up to 28 tokens): several buffers were used
    assert len(graphs._static) >= 3
    assert {size for size, _nb in graphs._static} >= {4, 2, 1}
    engine.check_integrity()


def test_graph_buckets():
    from tierguard.engine.decode_graphs import DecodeGraphs

    g = DecodeGraphs(lambda *a: None, 16, 64, 0, torch.device("cpu"), max_batch=16, capture=False)
    assert g.bucket(3, 5) == (4, 8)
    assert g.bucket(16, 64) == (16, 64)
    assert g.bucket(17, 1) is None  # over the largest batch: eager
    assert g.bucket(1, 65) is None  # over max blocks


def _quantized_bytes(float_model, kind: str) -> int:
    """What the weights of `float_model` take as `kind` (qlinear.py's formats): linear
    layers int8 (1 byte + a float16 scale per 32 inputs) or int4 (half a byte + float16
    scale and lo per 32 inputs); the embedding and lm_head int8 either way; float32 rest."""
    from tierguard.model.quantize import LINEAR_MODULES

    total = 0
    for name, t in float_model.named_parameters():
        module = name.rpartition(".")[0]
        quantized = name.endswith(".weight") and (module.rpartition(".")[2] in LINEAR_MODULES
                                                  or module in ("lm_head", "embed_tokens"))
        if not quantized:
            total += t.numel() * 4
            continue
        n, k = t.shape
        if kind == "int4" and module not in ("lm_head", "embed_tokens"):
            total += n * k // 2 + n * (k // 32) * 4
        else:
            total += n * k + n * -(-k // 32) * 2
    return total


# rms logit error over the prefill and 11 decode steps, on random weights (more sensitive to
# quantization than a trained model's): int8 groups of 32 ~0.01, int4 ~0.1 -- an int4 model
# that ran int8 would sit below int4's floor, one that ran float32 at 0
@pytest.mark.parametrize("weight_dtype,min_err,max_err", [("int8", 1e-4, 0.03), ("int4", 0.04, 0.3)],
                         ids=["int8", "int4"])
def test_quantized_engine_generates_close_to_float(tiny_dir, weight_dtype, min_err, max_err):
    from tierguard.model import fused_decode
    from tierguard.model.qlinear import Int4Linear, Int8Linear, QuantEmbedding

    base = build_engine(tiny_dir, kv_cache_gib=0.01, max_model_len=64, weight_dtype="auto")
    q = build_engine(tiny_dir, kv_cache_gib=0.01, max_model_len=64, weight_dtype=weight_dtype)
    assert q.runner.weight_dtype == weight_dtype
    model = q.runner.model
    linear = Int4Linear if weight_dtype == "int4" else Int8Linear
    for layer in model.layers:  # every linear layer is of the asked kind; the embedding int8
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(m) is linear, type(m)
    assert isinstance(model.embed_tokens, QuantEmbedding) and type(model.embed_tokens.linear) is Int8Linear
    assert q.runner.weight_bytes == _quantized_bytes(base.runner.model, weight_dtype)
    assert q.stats().extra["weight_bytes"] == q.runner.weight_bytes
    prompt = prompt_ids(7, 20)
    steps = 12
    rows = []
    q.logits_hook = lambda ids, lg: rows.append(lg[0].clone())
    out = q.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    if native.available():  # the decodes went through the fused step, on this kind's kernel
        decoder = model._fused
        assert isinstance(decoder, fused_decode.FusedDecoder) and decoder.steps >= steps - 1
        kind = fused_decode.KIND_INT4 if weight_dtype == "int4" else fused_decode.KIND_INT8
        assert {getattr(decoder._layers[i], n).kind for i in range(len(model.layers))
                for n in ("qkv", "o", "gate_up", "down")} == {kind}
    # float32's logits for the same context (prefill of the prompt and q's own tokens)
    hidden = []
    handle = base.runner.model.norm.register_forward_hook(lambda _m, _i, h: hidden.append(h.detach().clone()))
    base.generate([prompt + out[:-1]], SamplingParams(max_tokens=1, temperature=0.0))
    handle.remove()
    with torch.no_grad():
        ref = base.runner.model.compute_logits(hidden[0][len(prompt) - 1 :]).float()
    got = torch.stack(rows)
    assert got.shape == ref.shape == (steps, ref.shape[1])
    rel = ((got - ref).pow(2).mean(-1).sqrt() / ref.pow(2).mean(-1).sqrt())
    assert min_err < float(rel[0]) < max_err, rel  # the prefill
    assert min_err < float(rel[1:].mean()) < max_err and float(rel[1:].max()) < 2 * max_err, rel  # the decodes


def test_step_budget_learns_and_caps():
    budget = StepBudget(target_ms=100.0, min_tokens=16)
    assert budget.prefill_tokens(0, 512) == 512  # nothing decodes: no cap
    assert budget.prefill_tokens(2, 512) == UNMEASURED_CHUNK  # nothing measured yet
    budget.observe(0, 256, 0.512)  # a prefill alone: 2 ms per token
    budget.observe(2, 0, 0.040)  # two decodes: 40 ms
    assert budget.ms_per_prefill_token == pytest.approx(2.0)
    assert budget.prefill_tokens(2, 512) == 30  # (100 - 40) / 2
    # estimated 80 ms for 4: 20 ms of target left, but prefills get as long as the decodes
    assert budget.prefill_tokens(4, 512) == 40
    budget.prefill_share = 0.0  # without the share: 10 tokens -> the minimum
    assert budget.prefill_tokens(4, 512) == 16
    budget.prefill_share = 1.0
    budget.observe(2, 30, 0.100)  # 60 ms for 30 tokens beside 40 ms of decodes
    assert budget.ms_per_prefill_token == pytest.approx(2.0)
    assert StepBudget(0.0).prefill_tokens(5, 512) == 512  # off


def test_prefill_beside_decodes_is_chunked_to_the_target(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=128, target_itl_ms=50.0)
    budget = engine.scheduler.step_budget
    seen = []
    engine.add_step_listener(lambda s: seen.append((s.num_decode_seqs, s.num_prefill_tokens)))
    engine.add_request("a", prompt_ids(1, 8), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()  # a's prefill, alone: uncapped, and measured
    budget.ms_per_prefill_token = 5.0  # pretend the machine is slow: 10 tokens fit in 50 ms
    budget.decode_ms = {1: 0.0}
    engine.add_request(
        "b", prompt_ids(2, 100), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    for decode_ms, share in ((0.0, 1.0), (0.0, 1.0), (60.0, 1.0), (60.0, 0.0)):
        budget.ms_per_prefill_token, budget.decode_ms = 5.0, {1: decode_ms}  # hold the estimate
        budget.prefill_fixed_ms = 0.0
        budget.prefill_share = share
        engine.step()
    # 50 ms / 5 ms per token = 10 tokens beside the decode; when the decode alone takes
    # longer than the target, prefill gets as long as the decode (60 ms: 12 tokens), and
    # with no share the minimum (the block size, 4) still goes in
    assert [p for d, p in seen[1:]] == [10, 10, 12, 4]
    assert all(d == 1 for d, _p in seen[1:])
    engine.scheduler.step_budget = StepBudget(0.0)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_itl_slo_caps_the_batch_and_the_step():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=100.0)
    assert budget.enabled and budget.target_ms == 100.0  # the SLO is the step target
    assert budget.admits(0) and budget.admits(3)  # nothing measured: one more is tried
    budget.observe(0, 256, 0.512)  # 2 ms per prefill token
    budget.observe(4, 0, 0.050)  # 4 decodes: 50 ms, + the smallest chunk (4 tokens, 8 ms) <= 100
    assert budget.admits(4)  # 5 is unmeasured: 4's 50 ms scaled to 62.5, + 8 <= 100
    budget.observe(5, 0, 0.095)  # 5 decodes: 95 + 8 > 100
    assert not budget.admits(5) and not budget.admits(9)
    assert budget.admits(3)  # 4 is still fine
    assert budget.admits(0)  # an empty batch always takes one
    budget.decode_ms[5] = 70.0
    # no prefill share beyond the SLO: (100 - 70) / 2 = 15 (not raised to min_tokens)
    assert budget.prefill_tokens(5, 512) == 15
    assert budget.prefill_tokens(4, 512) == 25  # (100 - 50) / 2
    budget.decode_ms[5] = 97.0  # 3 ms of room: the queue still moves a little
    assert budget.prefill_tokens(5, 512) == SLO_MIN_TOKENS
    assert StepBudget(100.0).admits(50)  # the throughput-first target never holds requests back


def test_slo_chunk_cap_backs_off_after_an_overshoot_and_probes_back():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=90.0)
    budget.observe(4, 0, 0.030)
    for n in (10, 12, 14, 16, 11):
        budget.observe(4, n, (30.0 + 0.5 * n) / 1000)  # a flat line: a slope far too low
    assert budget.prefill_tokens(4, 512) > 64  # what the fit alone would let through
    budget.observe(4, 64, 0.240)  # and it did: 240 ms for a 90 ms SLO
    assert budget.slo_cap == 48.0
    assert budget.prefill_tokens(4, 512) <= 48
    budget.observe(4, 48, 0.120)
    assert budget.prefill_tokens(4, 512) <= 36  # over again: 0.75 x 48
    cap = budget.slo_cap
    budget.observe(4, int(cap), 0.080)  # the whole cap, under the SLO: probe upwards
    assert budget.slo_cap == cap + 2
    budget.observe(4, 5, 0.050)  # a step that did not use the cap says nothing about it
    assert budget.slo_cap == cap + 2
    budget.observe(4, 1, 0.500)  # however slow a step is, the cap keeps the smallest chunk
    assert budget.prefill_tokens(4, 512) == SLO_MIN_TOKENS
    assert StepBudget(100.0).slo_cap == float("inf")  # the throughput-first target has none


def test_one_slow_step_does_not_close_admission_for_good():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=90.0)
    budget.observe(0, 240, 0.672)  # 2.8 ms per token alone
    budget.observe(1, 0, 0.020)
    budget.observe(2, 0, 0.100)  # one slow step at 2 (noise): 100 ms, over the SLO alone
    # 2 decodes cost at most twice 1: 40 + a 4-token chunk (11 ms) fits 90
    assert budget.admits(1)
    budget.observe(3, 0, 0.085)
    assert not budget.admits(2)  # 3 is measured at 85 (within 1.5 x 2's 40-60): no room
    budget.decode_ms[2] = 30.0
    assert budget.admits(2)  # min(85, 30 x 3 / 2 = 45) + 11 fits


def test_a_stale_intercept_is_reprobed_after_a_window_without_mixed_steps():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=33.0)
    budget.observe(1, 0, 0.012)  # one decode: 12 ms
    # 2 decodes are not measured: 2 x 12 = 24 ms, + 12 fixed + a 4-token chunk (8) > 33
    budget.ms_per_prefill_token, budget.prefill_fixed_ms = 2.0, 12.0
    budget.steps_since_mixed = 0
    assert not budget.admits(1)
    for _ in range(SLO_REPROBE_STEPS - 1):  # one sequence at a time: its decodes alone
        budget.observe(1, 0, 0.012)
    assert not budget.admits(1)  # one step short of the window
    budget.observe(1, 0, 0.012)
    assert (budget.prefill_fixed_ms, budget.ms_per_prefill_token) == (12.0, 2.0)  # the fit is as stale as before
    assert budget.admits(1)  # the slope alone fits: 24 + 4 x 2 <= 33
    assert not budget.admits(1)  # one probe per window
    budget.observe(2, 6, 0.030)  # its chunk beside the decodes: the window starts again
    assert budget.steps_since_mixed == 0
    budget.prefill_fixed_ms, budget.ms_per_prefill_token = 12.0, 3.0  # the slope alone is too steep
    budget.steps_since_mixed = SLO_REPROBE_STEPS
    assert not budget.admits(1)  # 24 + 4 x 3 > 33: no probe



def test_a_chunk_that_cost_nothing_measurable_never_divides_by_zero():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=90.0)
    budget.observe(2, 0, 0.030)
    budget.observe(2, 4, 0.021)  # faster than its decodes' estimate (noise): 0 ms over
    assert PrefillCost(s0=1.0, s1=4.0, s2=16.0).solve() is None
    assert budget.prefill_tokens(2, 512) == UNMEASURED_CHUNK  # still unmeasured, no ZeroDivisionError
    budget.observe(0, 240, 0.672)
    assert budget.prefill_tokens(2, 512) == 21  # the seed from a prefill alone: (90 - 30) / 2.8


def test_prefill_alone_only_seeds_the_cost_of_a_chunk_beside_decodes():
    """Prefill-only steps run long chunks at about half the per-token cost of a small
    chunk beside decodes; one line through both regimes had an intercept no mixed step
    has, and admission read it as no room (the server ran one sequence at a time)."""
    budget = StepBudget(0.0, min_tokens=16, slo_ms=90.0)
    budget.observe(0, 240, 0.676)  # alone: 2.8 ms per token
    assert budget.ms_per_prefill_token == pytest.approx(676 / 240)
    budget.observe(1, 0, 0.021)
    for n in (14, 6, 10, 4, 12):
        budget.observe(1, n, (21.0 + 4.9 * n) / 1000)  # beside a decode: 4.9 ms per token
        budget.observe(0, 240, 0.676)  # more prefills alone change nothing now
    assert budget.ms_per_prefill_token == pytest.approx(4.9)
    assert budget.prefill_fixed_ms == pytest.approx(0.0, abs=1e-6)
    assert budget.admits(1)  # 21 + 4 x 4.9 <= 90; the mixed line (31 ms intercept) said no
    assert budget.prefill_tokens(1, 512) == 14  # (90 - 21) / 4.9


def test_prefill_cost_fits_a_fixed_part_and_a_slope():
    cost = PrefillCost(alpha=0.1)
    assert cost.solve() is None
    for n in (16, 64, 24, 200, 40, 16, 128):
        cost.add(n, 12.0 + 2.5 * n)  # 12 ms per step with prefill, 2.5 ms per token
    fixed, per = cost.solve()
    assert fixed == pytest.approx(12.0) and per == pytest.approx(2.5)
    same = PrefillCost()
    for _ in range(5):
        same.add(32, 96.0)  # one chunk size: no spread to split the two, a plain ratio
    assert same.solve() == (0.0, pytest.approx(3.0))
    odd = PrefillCost()
    odd.add(10, 100.0)
    odd.add(100, 110.0)
    odd.add(200, 100.0)  # a flat or falling line: no negative slope, a ratio instead
    fixed, per = odd.solve()
    assert fixed == 0.0 and per > 0


def test_slo_chunks_leave_room_for_the_fixed_cost():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=100.0)
    budget.observe(4, 0, 0.040)  # 4 decodes: 40 ms
    for n in (16, 48, 24, 64, 32):
        budget.observe(4, n, (40.0 + 20.0 + 1.0 * n) / 1000)  # 20 ms fixed, 1 ms per token
    assert budget.prefill_fixed_ms == pytest.approx(20.0)
    assert budget.ms_per_prefill_token == pytest.approx(1.0)
    # (100 - 40 - 20) / 1 = 40 tokens, where a ratio (~1.5 ms/token in this example) gave 40 / 1.5
    assert budget.prefill_tokens(4, 512) == 40
    budget.observe(6, 0, 0.075)
    budget.observe(7, 0, 0.077)
    assert not budget.admits(6)  # 7 decodes: 77 + 20 fixed + a 4-token chunk = 101 > 100
    assert budget.admits(4)  # 5: the nearest smaller measured (4): 40 + 24 <= 100


def test_itl_slo_holds_new_requests_in_the_queue(tiny_dir):
    engine = make_engine(tiny_dir, max_num_batched_tokens=128, itl_slo_ms=100.0, prefill_share=2.5)
    budget = engine.scheduler.step_budget
    assert budget.slo_ms == 100.0 and budget.prefill_share == 2.5  # the engine's settings reach it
    seen = []
    engine.add_step_listener(lambda s: seen.append(s.num_decode_seqs))
    for i in range(6):
        engine.add_request(f"r{i}", prompt_ids(i, 8), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    budget.observe(0, 64, 0.064)  # 1 ms per prefill token
    # a third stream leaves no room for a 4-token chunk (block size) within 100 ms
    budget.decode_ms = {2: 66.0, 3: 98.0}
    engine.step()
    assert len(engine.scheduler.running) == 2  # 2 fit (66 ms), a third would not (98 ms)
    for _ in range(4):
        budget.decode_ms = {2: 66.0, 3: 98.0}  # hold the estimates against the real timings
        budget.ms_per_prefill_token, budget.prefill_fixed_ms = 1.0, 0.0
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert len(engine.scheduler.waiting) == 4 and max(seen) <= 2
    engine.scheduler.step_budget = StepBudget(0.0)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_a_wave_grows_only_as_far_as_its_measured_decode_steps_fit():
    budget = StepBudget(0.0, min_tokens=16, slo_ms=20.0)
    assert not budget.wave_admits(1)  # nothing measured: a wave is one sequence
    budget.observe(1, 0, 0.006)
    assert budget.decode_ms == {1: 6.0}
    assert budget.wave_admits(1)  # 2 x 6 ms (linear) <= 0.75 x 20
    assert not budget.wave_admits(2)  # 3 x 6 = 18 ms > 15
    budget.observe(2, 0, 0.0065)  # measured: a step of 2 costs far less than twice 1
    assert budget.wave_admits(2) and budget.wave_admits(3)  # 4 x 6.5 / 2 = 13 ms
    assert not budget.wave_admits(4)  # 5 x 6.5 / 2 = 16.25 ms > 15
    assert budget.decode_step_ms(4) <= SLO_WAVE_SHARE * 20.0 < budget.decode_step_ms(5)
    off = StepBudget(0.0, slo_ms=0.0)
    off.observe(1, 0, 0.001)
    assert not off.wave_admits(1)  # no SLO, no waves


def _run(engine, prompts, max_tokens, before_step=lambda: None):
    outputs: dict[str, list[int]] = {}
    firsts: list[set[str]] = []  # per step: the requests whose first token it produced
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        before_step()
        new = set()
        for out in engine.step():
            if out.new_token_ids and out.request_id not in outputs:
                new.add(out.request_id)
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        firsts.append(new)
        engine.check_integrity()
    return outputs, firsts


def test_under_a_tight_slo_a_wave_prefills_together_and_starts_decoding_in_one_step(tiny_dir):
    """When no prefill chunk fits beside a decode within the SLO, sequences start as a
    wave: as many as the measured decode steps allow prefill in steps without decodes,
    hold their last prompt token, and all produce their first token in one step; the
    tokens are the ones the engine produces without an SLO."""
    prompts = [prompt_ids(70 + i, n) for i, n in enumerate([9, 30, 50, 17, 41, 23, 12])]
    plain = make_engine(tiny_dir, max_num_batched_tokens=32)
    want, _ = _run(plain, prompts, 5)
    engine = make_engine(tiny_dir, max_num_batched_tokens=32, itl_slo_ms=100.0)
    budget = engine.scheduler.step_budget
    seen, running = [], []
    engine.add_step_listener(lambda s: seen.append((s.num_decode_seqs, s.num_prefill_tokens)))

    def pin():  # a machine where 3 decodes fit 0.75 x 100 ms and no 4-token chunk fits beside one
        budget.decode_ms = {1: 20.0, 2: 25.0, 3: 30.0, 4: 80.0}
        budget.ms_per_prefill_token, budget.prefill_fixed_ms = 50.0, 0.0
        budget.steps_since_mixed = 0
        running.append(len(engine.scheduler.running))

    got, firsts = _run(engine, prompts, 5, pin)
    assert got == want
    assert max(running) == 3 and not any(d and p for d, p in seen), seen  # no mixed step
    waves = [f for f in firsts if f]
    assert [len(w) for w in waves] == [3, 3, 1], waves  # 7 requests: 3 + 3 + 1
    assert waves[0] == {"r0", "r1", "r2"} and waves[1] == {"r3", "r4", "r5"}
    # the wave's first tokens came after all 89 prompt tokens (32-token steps): r0's 9
    # tokens were done in step 1, yet it waited for the others
    assert firsts.index(waves[0]) == 3
    assert not engine.scheduler._held


@pytest.mark.parametrize("slo_ms", [1000.0, 0.0])
def test_a_held_token_makes_the_next_slo_step_decodes_only(tiny_dir, slo_ms):
    """A stream whose newest token showed no text has waited a step already: under an SLO
    the next step carries no prefill (never two such steps in a row); without one, nothing
    changes. A stop string longer than any token's text holds the first tokens back."""
    engine = make_engine(tiny_dir, max_num_batched_tokens=128, itl_slo_ms=slo_ms)
    stop = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["~" * 40])
    engine.add_request("held", prompt_ids(1, 8), stop)
    engine.step()  # its prefill and first token, whose text the stop string holds back
    held = engine.seqs["held"]
    assert held.text_held
    for i in range(3):
        engine.add_request(f"p{i}", prompt_ids(2 + i, 100), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    budget = engine.scheduler.step_budget
    seen = []
    engine.add_step_listener(lambda s: seen.append((s.num_decode_seqs, s.num_prefill_tokens)))
    for _ in range(4):
        budget.ms_per_prefill_token, budget.prefill_fixed_ms = 0.01, 0.0  # room for any chunk
        held.text_held = True  # as if each token were half a character
        engine.step()
    if slo_ms:
        assert [p for _, p in seen] == [0, seen[1][1], 0, seen[3][1]] and seen[1][1] > 0 and seen[3][1] > 0
    else:
        assert all(p > 0 for _, p in seen[:3]), seen  # 300 prompt tokens in 127-token chunks
    if slo_ms:  # after visible tokens no catch-up step: the last prompt tokens run
        for seq in engine.scheduler.running:  # random weights: any stream may hold half a character
            seq.text_held = False
        budget.ms_per_prefill_token, budget.prefill_fixed_ms = 0.01, 0.0
        engine.step()
        assert seen[-1][1] == 300 - seen[1][1] - seen[3][1] > 0
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("flag", ["--itl-slo-ms", "--prefill-share"])
def test_a_negative_step_budget_flag_is_one_line_and_exit_2(capsys, flag):
    from tierguard.cli.main import main

    assert main(["serve", "--model", "tiny", flag, "-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{flag} must be >= 0" in err
