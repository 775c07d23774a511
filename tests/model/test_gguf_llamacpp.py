"""GGUF export, read back with `gguf`; and (slow) a real llama.cpp server benchmarked.

The fast tests need only the optional `gguf` package; the slow one also needs
`llama-cpp-python[server]` (it compiles llama.cpp, so it is not a project dependency).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tierguard.common.errors import TierguardError
from tierguard.model.gguf_export import export_gguf, gguf_tensor_name, permute_for_gguf
from tierguard.model.tiny import create_tiny

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=400, max_position_embeddings=512)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny"), **SMALL, seed=3)


def _field(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        raise KeyError(key)
    return field.contents()


def test_permute_pairs_halves_within_each_head():
    heads, head_dim = 2, 6
    rows = np.arange(heads * head_dim, dtype=np.float32)[:, None].repeat(3, axis=1)
    out = permute_for_gguf(rows, heads)[:, 0].astype(int).tolist()
    # head 0 rows 0..5 = halves [0,1,2] [3,4,5] -> 0,3,1,4,2,5; head 1 likewise from 6.
    assert out == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
    assert gguf_tensor_name("model.layers.1.mlp.down_proj.weight") == "blk.1.ffn_down.weight"
    assert gguf_tensor_name("model.rotary_emb.inv_freq") is None


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_reads_back_with_gguf(small_dir, tmp_path, dtype):
    gguf = pytest.importorskip("gguf")
    out = export_gguf(small_dir, tmp_path / "m.gguf", dtype=dtype)
    reader = gguf.GGUFReader(str(out.path))
    cfg = json.loads((small_dir / "config.json").read_text())
    meta = {
        "general.architecture": "llama",
        "llama.context_length": SMALL["max_position_embeddings"],
        "llama.embedding_length": SMALL["hidden"],
        "llama.block_count": SMALL["layers"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": SMALL["heads"],
        "llama.attention.head_count_kv": SMALL["kv_heads"],
        "llama.rope.dimension_count": SMALL["hidden"] // SMALL["heads"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
    }
    assert {k: _field(reader, k) for k in meta} == meta
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert "im_start" in _field(reader, "tokenizer.chat_template")

    tok = json.loads((small_dir / "tokenizer.json").read_text())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == cfg["vocab_size"] and tokens[cfg["bos_token_id"]] == "<|begin_of_text|>"
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[cfg["eos_token_id"]] == gguf.TokenType.CONTROL and types[300] == gguf.TokenType.NORMAL
    assert len(_field(reader, "tokenizer.ggml.merges")) == len(tok["model"]["merges"])

    hf = load_file(str(small_dir / "model.safetensors"))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == out.tensors == 3 + 9 * SMALL["layers"]  # untied: `output` present
    for hf_name, weight in hf.items():
        t = tensors[gguf_tensor_name(hf_name)]
        assert list(t.shape) == list(reversed(weight.shape))  # GGUF lists dims innermost first
        want = "F16" if dtype == "f16" and weight.ndim == 2 else "F32"
        assert t.tensor_type.name == want
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32).reshape(
        hf["model.layers.0.self_attn.q_proj.weight"].shape
    )
    expect = permute_for_gguf(hf["model.layers.0.self_attn.q_proj.weight"], SMALL["heads"])
    np.testing.assert_allclose(q, expect, atol=1e-3 if dtype == "f16" else 0)
    v = np.asarray(tensors["blk.1.attn_v.weight"].data, dtype=np.float32)
    np.testing.assert_allclose(
        v.reshape(-1), hf["model.layers.1.self_attn.v_proj.weight"].reshape(-1), atol=1e-2
    )


def test_tied_embeddings_write_no_output_tensor(tmp_path):
    gguf = pytest.importorskip("gguf")
    tied = create_tiny(tmp_path / "tied", **{**SMALL, "layers": 1}, tie_word_embeddings=True)
    reader = gguf.GGUFReader(str(export_gguf(tied, tmp_path / "t.gguf").path))
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names


def test_unsupported_models_are_refused(tmp_path):
    pytest.importorskip("gguf")
    qwen3 = create_tiny(tmp_path / "q3", **{**SMALL, "layers": 1}, arch="qwen3")
    with pytest.raises(TierguardError, match="Llama/Mistral layouts only, not Qwen3"):
        export_gguf(qwen3, tmp_path / "q.gguf")
    scaled = create_tiny(
        tmp_path / "scaled", **{**SMALL, "layers": 1}, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    with pytest.raises(TierguardError, match="rope_scaling"):
        export_gguf(scaled, tmp_path / "s.gguf")
    assert not (tmp_path / "q.gguf").exists() and not (tmp_path / "s.gguf").exists()
    with pytest.raises(TierguardError, match="no config.json"):
        export_gguf(tmp_path / "missing", tmp_path / "x.gguf")


def test_missing_gguf_package_is_a_clear_error(small_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(TierguardError, match="pip install gguf"):
        export_gguf(small_dir, tmp_path / "m.gguf")


# ---------------------------------------------------------------- real llama.cpp server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_models(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """Poll /v1/models until the server answers; return the served model id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as resp:
                return json.loads(resp.read())["data"][0]["id"]
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama_cpp.server not healthy after {timeout_s}s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


# A first difference in greedy tokens is accepted only on a near-tie: two tokens whose
# logits (transformers' fp32 forward of the same weights) differ by less than this, which
# llama.cpp's f16 KV cache and its own summation order can flip. Anything else is a bug.
TIE_LOGIT = 0.02


def _greedy_agreement(model_dir: Path, gguf_path: Path, steps: int = 8) -> dict:
    """Tokenizer and greedy-token agreement of llama.cpp vs tierguard's engine, and at the
    first difference (if any) how far apart the two choices were in the model's logits."""
    from llama_cpp import Llama

    from tierguard.engine.api import SamplingParams
    from tierguard.engine.factory import build_engine

    text = "the memory cache token model layer block queue latency"
    engine = build_engine(
        model_dir, dtype="float32", device="cpu", kv_cache_gib=0.05, max_num_seqs=1, max_model_len=256
    )
    ids = engine.tokenizer.encode(text)
    ours = engine.generate([ids], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    llm = Llama(model_path=str(gguf_path), n_ctx=256, verbose=False)
    theirs_ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    theirs: list[int] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        theirs.append(int(token))
        if len(theirs) == steps:
            break
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), steps)
    margin = None
    if same < steps:  # both continued the same prefix up to here; how close were the two choices?
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ours[:same]])).logits[0, -1]
        margin = abs(float(logits[ours[same]] - logits[theirs[same]]))
    return {"tokenizer_equal": theirs_ids == ids, "ours": ours, "llama_cpp": theirs, "agree_prefix": same,
            "steps": steps, "tie_margin": margin}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tierguard_bench_against_real_llama_cpp_server(tmp_path):
    pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
    )
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python lacks the [server] extra")
    from tierguard.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    gguf_path = export_gguf(model_dir, tmp_path / "tiny.gguf").path
    agreement = _greedy_agreement(model_dir, gguf_path, steps=16)
    print("greedy agreement:", json.dumps(agreement))
    assert agreement["tokenizer_equal"]
    # Every greedy token equal, or the first difference on a near-tie (see TIE_LOGIT).
    if agreement["agree_prefix"] < agreement["steps"]:
        assert agreement["tie_margin"] < TIE_LOGIT, agreement

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "llama_server.log"
    args = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", "2048",
            # By default llama-cpp-python's server cancels the streaming request whenever
            # a new one arrives: at concurrency 2 that is 7 of 8 requests cut off
            # mid-response. It serves one request at a time either way.
            "--interrupt_requests", "False"]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(args, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        served = _wait_models(base, proc, log, timeout_s=120)
        out = tmp_path / "bench"
        bench = subprocess.run(
            [sys.executable, "-m", "tierguard", "bench", "--base-url", base, "--model", served,
             "--dataset", "fixed", "--input-len", "64", "--output-len", "16", "--num-requests", "8",
             "--max-concurrency", "2", "--no-progress", "--tokenizer", str(model_dir), "--output-dir", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    finally:
        _stop(proc)
    summary = json.loads((out / "summary.json").read_text())
    print(
        "llama.cpp bench:",
        {
            k: summary.get(k)
            for k in (
                "completed",
                "failed",
                "mean_ttft_ms",
                "p99_ttft_ms",
                "mean_itl_ms",
                "output_throughput",
            )
        },
    )
    assert summary["completed"] == 8, summary.get("errors")
    assert 0 < summary["mean_ttft_ms"] <= summary["p99_ttft_ms"] < 60_000
    assert summary["total_output_tokens"] > 0
