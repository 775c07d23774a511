"""The whole-stack C decode step (tierguard/model/fused_decode.py) computes what the
per-op path computes, for every weight kind it takes, and steps aside for what it does not."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_engine, prompt_ids
from tests.engine.test_hf_parity import run_and_record
from tierguard.engine.factory import build_engine
from tierguard.model import fused_decode, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the kernels are not built")

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
                              max_num_seqs=5, max_num_batched_tokens=tokens)
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
    """The C side holds raw pointers: a replaced weight must not be read through a stale one."""
    monkeypatch.setenv("TIERGUARD_FUSED_DECODE", "1")
    engine = make_engine(tiny_dir)
    _record(engine, PROMPTS[:2], max_tokens=3)
    model = engine.runner.model
    first = model._fused
    assert isinstance(first, fused_decode.FusedDecoder)
    with torch.no_grad():
        proj = model.layers[0].self_attn.o_proj
        proj.weight = torch.nn.Parameter(proj.weight.clone() * 0)
    second = model._fused_decoder()
    assert isinstance(second, fused_decode.FusedDecoder) and second is not first
    assert model._fused_decoder() is second  # unchanged weights: reused
    model.layers[1].self_attn.o_proj = torch.nn.Linear(proj.in_features, proj.out_features, bias=False)
    assert model._fused_decoder() is not second  # a replaced module, too
