"""Shared steps of the real-model parity tests: transformers loading a GGUF itself, and
our engine's greedy run with the logits of every sampled step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# 8 chat prompts x 64 greedy steps: what every real-model parity test compares.
STEPS = 64
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a CPU cache is in two sentences.",
    "What is 12 + 30?",
    "Translate 'good morning' into Spanish and French.",
    "List the planets of the solar system in order.",
    "Why is the sky blue?",
]


def hf_from_gguf(path: Path):
    """(tokenizer, float32 model) as transformers builds them from the GGUF file."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


def chat_prompts(tok, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template."""
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) for t in texts
    ]


def greedy_with_logits(engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs (ignoring EOS) and, per prompt, the [steps, vocab] logits sampled from."""
    from tierguard.engine.api import SamplingParams

    logits: dict[str, list[torch.Tensor]] = {}

    def hook(ids: list[str], rows: torch.Tensor) -> None:
        for rid, row in zip(ids, rows, strict=True):
            logits.setdefault(rid, []).append(row.detach().clone())

    engine.logits_hook = hook
    outputs = engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    rows = [torch.stack(logits[rid]) for rid in sorted(logits, key=lambda r: int(r.rsplit("-", 1)[1]))]
    return outputs, rows
