"""The whole-stack C decode step (tierguard/model/fused_decode.py) computes what the
per-op path computes, for every weight kind it takes, and steps aside for what it does not."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, prompt_ids
from tests.engine.test_hf_parity import run_and_record
from tests.needs import skip_without_kernels
from tierguard.engine.factory import build_engine
from tierguard.model import fused_decode, native

pytestmark = skip_without_kernels()

# 12 sequences (more than the kernel's 8-row chunk) of different lengths over 4-token blocks
PROMPTS = [prompt_ids(9 + 5 * i, 3 + 7 * i) for i in range(12)]


def _record(engine, prompts=PROMPTS, max_tokens=10):
    outputs, logits = run_and_record(engine, prompts, max_tokens=max_tokens)
    return outputs, {rid: torch.stack(rows) for rid, rows in logits.items()}


def _engine(model_dir, weight_dtype, fused: bool, monkeypatch):
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1" if fused else "0")
    if weight_dtype == "auto":
        return make_engine(model_dir, max_num_seqs=12, max_num_batched_tokens=64)
    return build_engine(
        model_dir, kv_cache_gib=0.01, max_model_len=128, weight_dtype=weight_dtype, max_num_seqs=12
    )


@pytest.mark.parametrize("weight_dtype", ["auto", "bf16", "int8", "int4"])
def test_fused_step_matches_the_per_op_path(tiny_dir, weight_dtype, monkeypatch):
    per_op = _engine(tiny_dir, weight_dtype, False, monkeypatch)
    ref = _record(per_op)
    assert per_op.runner.model._fused is False  # really the per-op path
    fused = _engine(tiny_dir, weight_dtype, True, monkeypatch)
    got = _record(fused)
    decoder = fused.runner.model._fused
    assert isinstance(decoder, fused_decode.FusedDecoder)
    assert decoder.steps >= 8  # the decode-only steps went through it
    assert got[0] == ref[0]
    tol = 3e-2 if weight_dtype == "bf16" else 1e-4  # bf16: see the test below
    for rid, lg in ref[1].items():
        err = (got[1][rid] - lg).abs().max().item()
        assert err < tol, (rid, err)
    fused.check_integrity()


def _chunked_steps_match(model_dir, weight_dtype, tokens, monkeypatch) -> int:
    """Runs prompts that take several prefill chunks each, through the per-op path and the
    fused step, checks every step with prefill went through the kernel in order and the
    logits agree; returns the number of steps that carried prefill."""
    prompts = [prompt_ids(40 + 9 * i, 37 + 11 * i) for i in range(5)]

    def run(fused: bool):
        monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1" if fused else "0")
        engine = build_engine(model_dir, kv_cache_gib=0.01, max_model_len=128, weight_dtype=weight_dtype,
                              max_num_seqs=5, max_num_batched_tokens=tokens,
                              target_itl_ms=0.0)  # chunks by the token budget alone, not by step times
        steps, flags = [], []
        engine.add_step_listener(lambda s: steps.append(s.num_prefill_tokens))
        real_run = fused_decode.FusedDecoder.run

        def run_spy(self, *args, ordered=False):
            flags.append(ordered)
            return real_run(self, *args, ordered=ordered)

        monkeypatch.setattr(fused_decode.FusedDecoder, "run", run_spy)
        return engine, steps, flags, _record(engine, prompts, max_tokens=6)

    _, _, _, ref = run(False)
    engine, steps, flags, got = run(True)
    assert engine.runner.model._fused.steps == len(steps)  # every step went through the kernel
    # a race between a chunk's rows is timing-dependent, so the flag is checked as well
    assert flags == [n > 0 for n in steps]
    assert got[0] == ref[0]
    # bf16 rounds each matmul's input rows: the per-op path's other rounding of the rope
    # can move a value across a bfloat16 step (2^-8 relative), so a looser bound there
    tol = 3e-2 if weight_dtype == "bf16" else 1e-4
    for rid, lg in ref[1].items():
        assert (got[1][rid] - lg).abs().max().item() < tol, rid
    engine.check_integrity()
    return sum(1 for n in steps if n > 0)


@pytest.mark.parametrize("weight_dtype", ["auto", "bf16", "int8"])
@pytest.mark.parametrize("tokens", [16, 64])
def test_steps_with_prefill_chunks_run_fused_and_match(tiny_dir, weight_dtype, tokens, monkeypatch):
    """A step that carries prefill chunks (first chunks and later ones over a cached
    prefix, beside decodes) runs as one fused call with a row per token, and every
    token's logits equal the per-op path's: a chunk's later rows must see the K/V its
    earlier rows wrote in the same step (the `ordered` barrier). Up to 16 rows every
    thread repeats the row-wise ops on its own copy; 64-token steps split them by rows."""
    mixed = _chunked_steps_match(tiny_dir, weight_dtype, tokens, monkeypatch)
    assert mixed >= (10 if tokens == 16 else 4)  # the prompts took many chunked steps


@pytest.mark.parametrize("weight_dtype", ["auto", "bf16"])
@pytest.mark.parametrize("variant", ["llama-hd64", "llama-hd128"])
def test_chunk_attention_tiles_of_wider_heads(variant, weight_dtype, variant_dir, monkeypatch):
    """Heads of 64 and 128 floats take the chunk attention's full output tiles (the tiny
    model's 16-float heads take the narrow ones)."""
    assert _chunked_steps_match(variant_dir(variant), weight_dtype, 64, monkeypatch) >= 4


@pytest.mark.parametrize("variant", ["qwen2", "llama3-rope-tied"])
def test_fused_step_with_biases_and_tied_embeddings(variant, variant_dir, monkeypatch):
    """q/k/v biases (Qwen2) are added inside the step; a tied head still works."""
    model_dir = variant_dir(variant)
    ref = _record(_engine(model_dir, "auto", False, monkeypatch), PROMPTS[:4])
    fused = _engine(model_dir, "auto", True, monkeypatch)
    got = _record(fused, PROMPTS[:4])
    assert fused.runner.model._fused.steps > 0
    assert got[0] == ref[0]
    for rid, lg in ref[1].items():
        assert (got[1][rid] - lg).abs().max().item() < 1e-4


def test_models_it_does_not_cover_keep_the_per_op_path(variant_dir, tiny_dir, monkeypatch, caplog):
    engine = _engine(variant_dir("qwen3"), "auto", True, monkeypatch)
    with caplog.at_level("INFO", logger="tierguard.model.fused_decode"):
        _record(engine, PROMPTS[:2], max_tokens=3)
    assert engine.runner.model._fused is False
    assert "q/k norm" in caplog.text
    model = make_engine(tiny_dir).runner.model
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "0")
    assert fused_decode.build(model) is None


def test_rebuilt_when_the_weights_move(tiny_dir, monkeypatch):
    """The C side holds raw pointers: after weights are replaced, the step's output is the
    new weights' (the per-op path's on them), never read through a stale pointer."""
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1")
    engine = make_engine(tiny_dir)
    before = _record(engine, PROMPTS[:2], max_tokens=6)
    model = engine.runner.model
    first = model._fused
    assert isinstance(first, fused_decode.FusedDecoder)
    with torch.no_grad():
        for layer in model.layers:  # new storage, new values: every layer's attention output halved
            proj = layer.self_attn.o_proj
            proj.weight = torch.nn.Parameter(proj.weight.clone() * 0.5)
    after = _record(engine, PROMPTS[:2], max_tokens=6)
    second = model._fused
    assert isinstance(second, fused_decode.FusedDecoder) and second.steps >= 5  # decodes ran fused
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "0")
    model._fused = None  # the per-op path on the same, new weights: the reference
    ref = _record(engine, PROMPTS[:2], max_tokens=6)
    assert model._fused is False
    assert after[0] == ref[0]
    for rid, lg in ref[1].items():
        assert (after[1][rid] - lg).abs().max().item() < 1e-4, rid
    # the new weights changed what the model computes, so the check above could fail
    assert max((after[1][r] - before[1][r]).abs().max().item() for r in before[1]) > 1e-3
    assert second is not first  # rebuilt, not patched
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1")
    model._fused = None
    third = model._fused_decoder()
    assert isinstance(third, fused_decode.FusedDecoder) and model._fused_decoder() is third  # unchanged: reused
    model.layers[1].self_attn.o_proj = torch.nn.Linear(proj.in_features, proj.out_features, bias=False)
    assert model._fused_decoder() is not third  # a replaced module, too


def _chunk_rows(engine, prompt: list[int], order: list[int], threads: int) -> torch.Tensor:
    """One fused call whose rows are the tokens of one prefill chunk (`ordered`), given to
    the kernel in `order`, on a pool whose other slots hold garbage; the rows' hidden
    states, put back in position order."""
    model, cfg, bs = engine.runner.model, engine.runner.cfg, engine.config.block_size
    kv = engine.runner.kv_cache
    n = len(prompt)
    blocks = list(range(1, -(-n // bs) + 1))
    with torch.no_grad():
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(5)) * 30)  # stale slots
    tables = torch.zeros(2, 16, dtype=torch.int32)
    tables[1, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    pos = torch.tensor(order, dtype=torch.long)
    call = native.DecodeCall(tables, torch.ones(n, dtype=torch.int32), (pos + 1).to(torch.int32), n,
                             cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs)
    x = model.embed_tokens(torch.tensor(prompt)[pos])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            out = model._fused_decoder().run(x, model.rotary.tables(pos, x.dtype), kv, call, ordered=True)
    finally:
        torch.set_num_threads(old)
    assert out is not None
    return out[torch.argsort(pos)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunks_rows_see_each_other_in_any_order(tiny_dir, threads, monkeypatch):
    """With `ordered`, every row's K/V is in the pool before any row attends: a chunk's
    rows given last-position-first compute what they compute in order. On one thread an
    unordered step would run the rows one after another, so a row would read its later
    neighbours' slots before they were written (the garbage put there) -- deterministic,
    unlike the race the flag prevents on several threads."""
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1")
    engine = make_engine(tiny_dir)
    prompt = prompt_ids(3, 11)
    forward = _chunk_rows(engine, prompt, list(range(11)), threads)
    backward = _chunk_rows(engine, prompt, list(range(10, -1, -1)), threads)
    torch.testing.assert_close(backward, forward, rtol=1e-5, atol=1e-5)
    # and in order, the rows equal the per-op path's prefill of the same chunk
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "0")
    ref_engine = make_engine(tiny_dir)
    hidden = []
    handle = ref_engine.runner.model.norm.register_forward_hook(lambda _m, _i, o: hidden.append(o.detach().clone()))
    from tierguard.engine.api import SamplingParams

    ref_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    handle.remove()
    torch.testing.assert_close(forward, hidden[0], rtol=1e-4, atol=1e-4)
