"""import-gguf: round trip with export-gguf, every dequantizable type, bad input, the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.needs import need_module
from tierguard.common.errors import TierguardError
from tierguard.model.gguf_export import export_gguf, permute_for_gguf
from tierguard.model.gguf_import import cached_import, import_gguf
from tierguard.model.gguf_reader import unpermute_qk
from tierguard.model.st_writer import to_dtype
from tierguard.model.tiny import create_tiny
from tierguard.model.tokenizer import HFTokenizer

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=400, max_position_embeddings=512)
LICENSE = Path("/usr/share/common-licenses/GPL-3")


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _real_text() -> str:
    if LICENSE.is_file():
        return LICENSE.read_text()[:20000]
    return Path(__file__).read_text()  # this file is real text too


@pytest.fixture(scope="module")
def gguf():
    """The `gguf` package, for the tests that write or read GGUF files (the q/k permutation,
    the bfloat16 conversion and the tokenizer's refusals need none)."""
    return need_module("gguf", "pip install -e '.[gguf]'")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny"), **SMALL, seed=5)


def test_unpermute_inverts_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_for_gguf(w, 3), 3), w)
    b = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_for_gguf(b, 2), 2), b)


@pytest.mark.parametrize("tied", [False, True])
def test_export_import_round_trip_is_bit_identical(tmp_path, tied, gguf):
    src = create_tiny(tmp_path / "src", **SMALL, seed=7, tie_word_embeddings=tied)
    path = export_gguf(src, tmp_path / "m.gguf").path
    out = import_gguf(path, tmp_path / "back")
    want, got = _tensors(src), _tensors(out.path)
    if tied:
        want.pop("lm_head.weight", None)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name  # q/k rows back in HF order, every bit
    cfg_src, cfg_back = (json.loads((d / "config.json").read_text()) for d in (src, out.path))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                "bos_token_id", "eos_token_id", "tie_word_embeddings"):  # fmt: skip
        assert cfg_src[key] == cfg_back[key], key
    assert cfg_back["rms_norm_eps"] == pytest.approx(cfg_src["rms_norm_eps"])
    a, b = HFTokenizer(src), HFTokenizer(out.path)
    text = _real_text()
    assert a.encode(text) == b.encode(text) and len(a.encode(text)) > 1000
    assert b.decode(b.encode(text)) == a.decode(a.encode(text))
    chat = [{"role": "user", "content": "Where is the pass key?"}]
    assert b.apply_chat_template(chat) == a.apply_chat_template(chat)
    assert b.eos_token_id == a.eos_token_id


def _write_gguf(path: Path, tensors: dict, *, arch: str = "llama", tokenizer: bool = True, inter: int = 128) -> Path:
    """A small llama GGUF with the given (already quantized) tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        tokens = [chr(0x100 + i) if i > 3 else f"<s{i}>" for i in range(299)] + ["\u0104\u0105"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([3] * 4 + [1] * 296)
        w.add_token_merges(["\u0104 \u0105"])
        w.add_eos_token_id(1)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _layer(rng, qtype, inter: int = 128) -> tuple[dict, dict[str, np.ndarray]]:
    """A one-layer model's tensors quantized to `qtype` (norms stay F32), and the originals."""
    import gguf

    shapes = {
        "token_embd.weight": (300, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
        "blk.0.ffn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
        "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
        "blk.0.ffn_gate.weight": (inter, 64), "blk.0.ffn_up.weight": (inter, 64),
        "blk.0.ffn_down.weight": (64, inter),
    }  # fmt: skip
    F32 = gguf.GGMLQuantizationType.F32
    out, orig = {}, {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        orig[name] = x
        if len(shape) == 1:
            out[name] = (x, F32)
        else:
            out[name] = (gguf.quants.quantize(x, qtype), qtype)
    return out, orig


@pytest.mark.parametrize("qname", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_types_import_as_gguf_dequantizes_them(tmp_path, qname, gguf):
    qtype = gguf.GGMLQuantizationType[qname]
    tensors, orig = _layer(np.random.default_rng(1), qtype)
    path = _write_gguf(tmp_path / "q.gguf", tensors)
    got = _tensors(import_gguf(path, tmp_path / "out").path)
    q = got["model.layers.0.self_attn.q_proj.weight"].numpy()
    want_q = unpermute_qk(gguf.quants.dequantize(tensors["blk.0.attn_q.weight"][0], qtype).reshape(64, 64), 4)
    np.testing.assert_array_equal(q, want_q)
    # and close to the unquantized original, rows in HF order
    err = np.abs(q - unpermute_qk(orig["blk.0.attn_q.weight"], 4)).max()
    assert err < {"F16": 1e-2, "BF16": 2e-2, "Q8_0": 5e-2}.get(qname, 0.6)
    assert got["model.norm.weight"].dtype == torch.float32


@pytest.mark.parametrize("qname", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"])
def test_k_quants_import_bit_exact_to_gguf_dequantize(tmp_path, qname, gguf):
    """Python has no K-quant quantizer: random blocks (fp16 scales kept finite) stand in."""
    qtype = gguf.GGMLQuantizationType[qname]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(3)
    tensors, _ = _layer(rng, gguf.GGMLQuantizationType.F16, inter=256)
    raw = rng.integers(0, 256, size=(64, 256 // block * size), dtype=np.uint8)
    halves = raw.view(np.uint16)
    halves[(halves & 0x7C00) == 0x7C00] &= 0x3FFF  # no inf/NaN fp16 scales
    tensors["blk.0.ffn_down.weight"] = (raw, qtype)
    path = _write_gguf(tmp_path / "k.gguf", tensors, inter=256)
    got = _tensors(import_gguf(path, tmp_path / "out").path)["model.layers.0.mlp.down_proj.weight"].numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw, qtype).reshape(64, 256))


def test_bfloat16_conversion_rounds_as_torch_does():
    """Ties to even both ways (1 + 2^-8 stays 1, 1 + 3 x 2^-8 goes up), not truncated; no gguf."""
    x = np.array([1.0, -2.5, 3.14159, 1e-8, 65504.0, 1 + 2**-8, 1 + 3 * 2**-8, float("nan")], np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = to_dtype(x, "bfloat16")
    np.testing.assert_array_equal(got[:-1], want[:-1])
    assert got[6] != (x[6:7].view(np.uint32)[0] >> 16)  # truncation would differ here
    assert (got[-1] & 0x7F80) == 0x7F80 and (got[-1] & 0x7F)  # NaN stays NaN


def test_bfloat16_and_float16_outputs_match_torch_casts(tmp_path, tiny, gguf):
    path = export_gguf(tiny, tmp_path / "m.gguf").path
    ref = _tensors(tiny)
    for dtype, tdtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        got_t = _tensors(import_gguf(path, tmp_path / dtype, dtype=dtype).path)
        for name, t in ref.items():
            assert got_t[name].dtype == tdtype
            assert torch.equal(got_t[name], t.to(tdtype)), name
        assert json.loads((tmp_path / dtype / "config.json").read_text())["torch_dtype"] == dtype


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (main() is what the console script runs), for speed."""
    import contextlib
    import io

    from tierguard.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _assert_one_line_exit_2(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_inputs_are_one_line_and_leave_nothing(tmp_path, tiny, gguf):
    good = export_gguf(tiny, tmp_path / "good.gguf").path
    data = good.read_bytes()
    cases = {}
    (tmp_path / "text.gguf").write_text("not a gguf at all\n")
    cases["text.gguf"] = ("not a GGUF file",)
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    cases["cut.gguf"] = ("truncated",)
    (tmp_path / "head.gguf").write_bytes(data[:64])
    cases["head.gguf"] = ("truncated or damaged",)
    rng = np.random.default_rng(0)
    tensors, _ = _layer(rng, gguf.GGMLQuantizationType.F16)
    _write_gguf(tmp_path / "notok.gguf", tensors, tokenizer=False)
    cases["notok.gguf"] = ("no tokenizer",)
    _write_gguf(tmp_path / "phi.gguf", tensors, arch="phi2")
    cases["phi.gguf"] = ("unsupported GGUF architecture 'phi2'",)
    q8k = dict(tensors)
    q8k["blk.0.ffn_up.weight"] = (np.zeros((128, 292), np.uint8), gguf.GGMLQuantizationType.Q8_K)
    _write_gguf(tmp_path / "q8k.gguf", q8k)
    cases["q8k.gguf"] = ("blk.0.ffn_up.weight", "Q8_K", "cannot dequantize")
    for name, words in cases.items():
        out = tmp_path / f"out-{name}"
        res = _cli("model", "import-gguf", str(tmp_path / name), str(out))
        _assert_one_line_exit_2(res, *words)
        assert not out.exists(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temp dir was left behind"
    # an existing, non-empty output directory is refused, and left as it was
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("x")
    _assert_one_line_exit_2(_cli("model", "import-gguf", str(good), str(busy)), "not an empty directory")
    assert [p.name for p in busy.iterdir()] == ["keep"]


def test_import_cli_and_cached_import_reuse(tmp_path, tiny, monkeypatch, gguf):
    path = export_gguf(tiny, tmp_path / "tiny.gguf").path
    res = _cli("model", "import-gguf", str(path), str(tmp_path / "out"), "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert "LlamaForCausalLM" in res.stdout and "F32" in res.stdout
    first = cached_import(path, cache_dir=tmp_path / "cache")
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_import(path, cache_dir=tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # not imported twice
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    assert cached_import(copy, cache_dir=tmp_path / "cache").name.split("-")[-2] == first.name.split("-")[-2]


def test_unsupported_pre_tokenizer_is_refused():
    from tierguard.model import gguf_tokenizer

    with pytest.raises(TierguardError, match="tokenizer.ggml.pre 'mystery'"):
        gguf_tokenizer._pre_tokenizer("mystery")


@pytest.mark.parametrize("weight_dtype,linear_type", [("int8", "Q8_0"), ("int4", "Q4_1"), ("int8", "Q4_1")])
def test_quantized_layers_take_the_files_blocks(tmp_path, monkeypatch, weight_dtype, linear_type, gguf):
    """With the GGUF file at hand, int8 layers (and the int8 embedding, int4 or not) take its
    Q8_0 blocks and int4 ones its Q4_1 blocks as they are: every dequantized weight equals
    the float import bit for bit, q/k rows in HF order. Q4_1 into int8 is quantized at load."""
    from tierguard.model.loader import load_model
    from tierguard.model.qlinear import Int4Linear, Int8Linear

    tensors, _ = _layer(np.random.default_rng(4), gguf.GGMLQuantizationType[linear_type])
    x = np.random.default_rng(5).standard_normal((300, 64)).astype(np.float32)
    tensors["token_embd.weight"] = (gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                    gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    path = _write_gguf(tmp_path / "q.gguf", tensors)
    floats = _tensors(import_gguf(path, tmp_path / "out").path)
    from tierguard.model.quantize import WeightQuantizer

    from_float = []  # the layers quantized at load from float32 (the others: the file's blocks)
    orig = WeightQuantizer.linear

    def linear(self, w, *args, **kwargs):
        from_float.append(tuple(w.shape))
        return orig(self, w, *args, **kwargs)

    monkeypatch.setattr(WeightQuantizer, "linear", linear)
    model, *_ = load_model(tmp_path / "out", "float32", "cpu", weight_dtype=weight_dtype, gguf_path=path)
    assert len(from_float) == (4 if (weight_dtype, linear_type) == ("int8", "Q4_1") else 0)
    embed = model.embed_tokens.linear
    assert isinstance(embed, Int8Linear)
    raw = tensors["token_embd.weight"][0].reshape(300, 2, 34)
    assert np.array_equal(embed.qweight.numpy(), raw[..., 2:].copy().view(np.int8).reshape(300, 64))
    assert torch.equal(embed.rows(torch.arange(300)), floats["model.embed_tokens.weight"])
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    want_qkv = torch.cat([floats[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    want_gu = torch.cat([floats[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    for layer, want in ((attn.qkv_proj, want_qkv), (mlp.gate_up_proj, want_gu),
                        (mlp.down_proj, floats["model.layers.0.mlp.down_proj.weight"])):  # fmt: skip
        assert isinstance(layer, Int8Linear if weight_dtype == "int8" else Int4Linear)
        dense = layer.rows(torch.arange(layer.out_features))
        if linear_type == "Q4_1" and weight_dtype == "int8":  # re-quantized: within half a step
            assert 0 < float((dense - want).abs().max()) <= float(want.abs().max()) / 127 / 2 * 1.001
        else:
            assert torch.equal(dense, want)
