"""Shared fixtures: tiny fp32 models built once per session, engines, HF references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.needs import need_module
from tierguard.engine.config import EngineConfig
from tierguard.engine.llm_engine import LLMEngine
from tierguard.model.loader import load_model
from tierguard.model.tiny import create_tiny
from tierguard.model.tokenizer import HFTokenizer

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, max_position_embeddings=512, seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny-llama"), **SMALL)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """Variants for parity tests; built lazily by `variant_dir`."""
    return {"llama": tiny_dir}


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory, model_dirs):
    def get(name: str) -> Path:
        if name not in model_dirs:
            kwargs = dict(SMALL, seed=3)
            if name == "qwen2":
                kwargs.update(arch="qwen2")
            elif name == "mistral":
                kwargs.update(arch="mistral")
            elif name == "qwen3":
                kwargs.update(arch="qwen3", vocab=400, head_dim=32)  # != hidden / heads
            elif name == "llama-hd64":
                kwargs.update(hidden=128, heads=2, kv_heads=1)  # G = 2 query heads per KV head
            elif name == "llama-hd128":
                kwargs.update(hidden=256, heads=2, kv_heads=1)
            elif name == "llama3-rope-tied":
                kwargs.update(
                    tie_word_embeddings=True,
                    rope_theta=500000.0,
                    rope_scaling={
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64,
                    },
                )
            else:
                raise KeyError(name)
            model_dirs[name] = create_tiny(tmp_path_factory.mktemp(name), **kwargs)
        return model_dirs[name]

    return get


def make_engine(model_dir: Path, faults=None, **overrides) -> LLMEngine:
    model, cfg, dtype, device = load_model(model_dir, "float32", "cpu")
    settings = dict(
        num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256
    )
    settings.update(overrides)
    return LLMEngine(
        model,
        cfg,
        HFTokenizer(model_dir),
        EngineConfig(**settings),
        dtype,
        device,
        model_name=model_dir.name,
        faults=faults,
    )


def batch_then_chats(engine, long, chats: dict, params, long_params=None, on_chat=lambda: None,
                     after_step=lambda: None) -> dict[str, list[int]]:
    """Run a batch request ("batch", `long_params` or `params`), add the interactive ones
    (`chats`: request id -> prompt) at step 3, when it decodes (after `on_chat()`), and run
    all to the end, checking integrity and calling `after_step()` after every step.
    Returns every request's output tokens."""
    out: dict[str, list[int]] = {"batch": [], **{rid: [] for rid in chats}}
    engine.add_request("batch", long, long_params or params, request_class="batch")
    for step in range(10_000):
        if step == 3:
            on_chat()
            for rid, prompt in chats.items():
                engine.add_request(rid, prompt, params)
        elif step > 3 and not engine.has_unfinished():
            break
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
        after_step()
    return out


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own implementation of the same weights (the reference). transformers
    is imported when a test first asks for a model, not when it asks for the fixture, so a
    test runs its own engine checks first and only its comparison needs the package
    (tests/needs.py: a named skip without it, a failure under CI=true)."""
    cache: dict[Path, object] = {}

    def get(model_dir: Path):
        transformers = need_module("transformers")
        if model_dir not in cache:
            m = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            cache[model_dir] = m.eval()
        return cache[model_dir]

    return get


def hf_step_logits(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF logits that predicted each output token: rows len(prompt)-1 .. len(prompt)+len(output)-2."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float()


def prompt_ids(seed: int, n: int, vocab: int = 400) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()
