"""create_tiny / ensure_tiny_model, the tokenizer wrapper, config parsing, CLI."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from tierguard.cli.main import main as cli_main
from tierguard.common.errors import TierguardError
from tierguard.model.config import ModelConfig
from tierguard.model.layers import rope_inv_freq
from tierguard.model.tiny import create_tiny, ensure_tiny_model
from tierguard.model.tokenizer import HFTokenizer

SMALL = dict(layers=1, hidden=32, heads=2, kv_heads=1, vocab=300, max_position_embeddings=64)


def digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_tiny(tmp_path_factory.mktemp("t"), **SMALL, seed=5)


def test_create_tiny_is_deterministic_under_seed(tiny, tmp_path):
    again = create_tiny(tmp_path / "again", **SMALL, seed=5)
    assert digest(again) == digest(tiny)
    other = create_tiny(tmp_path / "other", **SMALL, seed=6)
    assert digest(other)["model.safetensors"] != digest(tiny)["model.safetensors"]
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"


def test_tokenizer_round_trips_ascii_and_matches_transformers(tiny):
    tok = HFTokenizer(tiny)
    text = 'Prefix caching: KV blocks 0..15 -> host {"k": [1, 2]}\tend ~!'
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.eos_token_id is not None and tok.eos_token_id < tok.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("assistant\n") and "hi" in chat
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny))
    assert hf(text)["input_ids"] == ids
    assert (
        hf.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        == chat
    )
    assert hf.eos_token_id == tok.eos_token_id
    assert hf(chat)["input_ids"] == tok.encode(chat)  # special tokens in the template text
    assert tok.encode(chat).count(tok.eos_token_id) == 1


def test_ensure_tiny_model_builds_once_even_when_raced(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERGUARD_CACHE", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(ensure_tiny_model(**SMALL))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    path = results[0]
    assert path.parent.parent == tmp_path and (path / "config.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(**SMALL) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".build-")] == []


def test_config_rejects_unknown_architecture():
    with pytest.raises(TierguardError, match="unsupported model architecture"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8})


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    mine = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(mine, ref, rtol=1e-6)
    assert not torch.allclose(mine, rope_inv_freq(128, 500000.0, None))


def test_cli_create_tiny(tmp_path, capsys):
    assert (
        cli_main(
            [
                "model",
                "create-tiny",
                str(tmp_path / "m"),
                "--layers",
                "1",
                "--hidden",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--vocab",
                "300",
                "--max-position-embeddings",
                "64",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert cli_main(["model", "create-tiny", str(tmp_path / "bad"), "--hidden", "30", "--heads", "4"]) == 2
    assert "--hidden" in capsys.readouterr().err


def test_unwritable_output_is_one_line_and_exit_2(tmp_path, capsys):
    from tierguard.cli.main import main

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["model", "create-tiny", str(blocker / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierguard: error:") and err.count("\n") == 1 and str(blocker) in err
