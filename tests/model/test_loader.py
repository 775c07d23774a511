"""Loading from local directories: sharded checkpoints, dtypes, bad directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierguard.common.errors import TierguardError
from tierguard.model.loader import load_model
from tierguard.model.tiny import create_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_tiny(
        tmp_path_factory.mktemp("t"),
        layers=2,
        hidden=32,
        heads=2,
        kv_heads=1,
        vocab=300,
        max_position_embeddings=64,
        seed=2,
    )


def test_sharded_checkpoint_loads_the_same_weights(tiny, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    a, *_ = load_model(tiny, "float32", "cpu")
    b, *_ = load_model(sharded, "float32", "cpu")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(TierguardError, match="missing"):
        load_model(sharded, "float32", "cpu")


def test_dtype_auto_and_override(tiny):
    model, cfg, dtype, device = load_model(tiny, "auto", "cpu")
    assert dtype == torch.float32 and device.type == "cpu"
    model16, *_ = load_model(tiny, "bfloat16", "cpu")
    assert model16.embed_tokens.weight.dtype == torch.bfloat16
    assert model16.rotary.cos.dtype == torch.float32  # rotary tables stay fp32
    with pytest.raises(TierguardError, match="dtype"):
        load_model(tiny, "int3", "cpu")


def test_bad_directories(tmp_path):
    with pytest.raises(TierguardError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TierguardError, match="not valid JSON"):
        load_model(tmp_path)
