"""Weight offload: identical greedy outputs, one copy per offloaded layer per step, budgets."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from tests.engine.conftest import SMALL, make_engine, prompt_ids
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.engine.weight_offload import WeightOffloader, layer_bytes
from tierguard.model.tiny import create_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    return create_tiny(tmp_path_factory.mktemp("tiny4"), **dict(SMALL, layers=4))


def _prompts() -> list[list[int]]:
    return [prompt_ids(1, 30), prompt_ids(2, 7), prompt_ids(3, 19)]


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4])
def test_outputs_identical_with_and_without_offload(four_layer_dir, num_layers):
    plain = make_engine(four_layer_dir, max_num_batched_tokens=16).generate(_prompts(), GREEDY)
    engine = make_engine(four_layer_dir, max_num_batched_tokens=16)
    offloader = WeightOffloader(engine.runner.model, num_layers)
    assert engine.generate(_prompts(), GREEDY) == plain
    assert offloader.stats().copies_total > 0
    offloader.detach()  # layers get their own weights back
    assert engine.runner.model.weight_offloader is None
    assert engine.generate(_prompts(), GREEDY) == plain


def test_one_copy_per_offloaded_layer_per_step(four_layer_dir):
    engine = make_engine(four_layer_dir)
    offloader = WeightOffloader(engine.runner.model, 3)
    engine.add_request("r", prompt_ids(4, 10), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    counts = [offloader.stats().copies_total]
    while engine.has_unfinished():
        engine.step()
        counts.append(offloader.stats().copies_total)
    assert [b - a for a, b in zip(counts, counts[1:], strict=False)] == [3] * (len(counts) - 1)
    stats = offloader.stats()
    per_layer = layer_bytes(engine.runner.model.layers[0])
    assert stats.copy_bytes_total == stats.copies_total * per_layer
    assert stats.copy_seconds_total > 0
    extra = engine.stats().extra  # exported by serve as tierguard:engine_<key> gauges
    assert extra["weights_offload_layers"] == 3
    assert extra["weights_offload_bytes"] == 3 * per_layer
    assert extra["weights_offload_copies_total"] == stats.copies_total
    assert extra["weights_offload_copy_seconds_total"] >= stats.copy_seconds_total
    offloader.detach()


def test_offloaded_layers_share_two_staging_slots(four_layer_dir):
    engine = make_engine(four_layer_dir)
    model = engine.runner.model
    offloader = WeightOffloader(model, 4)
    ptrs = [layer.mlp.down_proj.weight.data_ptr() for layer in model.layers]
    assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
    assert offloader.stats().device_bytes_saved == 2 * layer_bytes(model.layers[0])
    assert not any(p.requires_grad for p in model.layers[3].parameters())
    offloader.detach()
    assert len({layer.mlp.down_proj.weight.data_ptr() for layer in model.layers}) == 4


def test_budget_picks_whole_layers_and_validates(tiny_dir):
    engine = make_engine(tiny_dir)
    per_layer = layer_bytes(engine.runner.model.layers[0])
    assert WeightOffloader.attach(engine.runner.model, 0) is None
    with pytest.raises(TierguardError, match="exceeds the model's decoder layer weights"):
        WeightOffloader.attach(engine.runner.model, 3 * per_layer / GIB)
    with pytest.raises(TierguardError, match="smaller than one decoder layer"):
        WeightOffloader.attach(engine.runner.model, per_layer / 2 / GIB)
    offloader = WeightOffloader.attach(engine.runner.model, 1.5 * per_layer / GIB)
    assert offloader is not None and offloader.stats().layers == 1
    offloader.detach()


def test_factory_and_flags(tiny_dir):
    engine = build_engine(tiny_dir, dtype="float32", device="cpu", kv_cache_gib=0.01)
    per_layer = layer_bytes(engine.runner.model.layers[0])
    want = engine.generate([prompt_ids(5, 12)], GREEDY)
    engine = build_engine(
        tiny_dir, dtype="float32", device="cpu", kv_cache_gib=0.01, weights_offload_gib=2 * per_layer / GIB
    )
    assert engine.generate([prompt_ids(5, 12)], GREEDY) == want
    assert engine.stats().extra["weights_offload_layers"] == 2
    with pytest.raises(TierguardError, match="weights-offload-gib"):
        build_engine(tiny_dir, device="cpu", weights_offload_gib=-1)
    with pytest.raises(TierguardError, match="weights-offload-gib"):
        build_engine(tiny_dir, device="cpu", kv_cache_gib=0.01, weights_offload_gib=1.0)

    from tierguard.cli import serve

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve.add_parser(sub)
    args = parser.parse_args(["serve", "--kv-dtype", "int8", "--weights-offload-gib", "0.5"])
    assert serve._engine_kwargs(args)["kv_dtype"] == "int8"
    assert serve._engine_kwargs(args)["weights_offload_gib"] == 0.5
    with pytest.raises(TierguardError, match="weights-offload-gib"):
        serve._validate(parser.parse_args(["serve", "--weights-offload-gib", "-2"]))


def test_offload_with_quantized_kv_matches_quantized_kv(tiny_dir):
    want = make_engine(tiny_dir, kv_dtype="int8").generate(_prompts(), GREEDY)
    engine = make_engine(tiny_dir, kv_dtype="int8")
    WeightOffloader(engine.runner.model, 2)
    assert engine.generate(_prompts(), GREEDY) == want
    assert torch.is_tensor(engine.runner.kv_scale)


def test_async_engine_from_model_dir_with_both_knobs(tiny_dir):
    from tierguard.engine.async_engine import AsyncLLMEngine

    per_layer = layer_bytes(make_engine(tiny_dir).runner.model.layers[0])

    async def main() -> dict[str, float]:
        engine = AsyncLLMEngine.from_model_dir(
            tiny_dir,
            dtype="float32",
            device="cpu",
            kv_cache_gib=0.01,
            max_model_len=256,
            kv_dtype="fp8",
            weights_offload_gib=per_layer / GIB,
        )
        try:
            outs = [o async for o in engine.generate("a", prompt_ids(6, 20), GREEDY)]
            assert outs[-1].finished and outs[-1].num_output_tokens == GREEDY.max_tokens
            return engine.stats().extra
        finally:
            await engine.shutdown()

    extra = asyncio.run(main())
    assert extra["kv_quantized"] == 1.0
    assert extra["weights_offload_layers"] == 1
    assert extra["weights_offload_copies_total"] >= GREEDY.max_tokens
