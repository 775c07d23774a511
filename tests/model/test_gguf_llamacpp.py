"""GGUF export, read back with `gguf`; and (slow) llama.cpp itself: SmolLM2 exported and
decoded greedily under llama.cpp against our engine, and a real llama.cpp server
benchmarked by `tierguard bench`.

The fast tests need only the optional `gguf` package; the slow ones also need
`llama-cpp-python[server]`, which compiles llama.cpp and so is not a project dependency:
`make test` installs it into its own venv and names that interpreter in
TIERGUARD_LLAMA_PYTHON (else .venv-llamacpp/bin/python, else this interpreter).
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


ROOT = Path(__file__).resolve().parents[2]
GREEDY_SCRIPT = Path(__file__).with_name("llamacpp_greedy.py")


def llama_python() -> str:
    """An interpreter with llama_cpp.server, or a named skip."""
    candidates = [os.environ.get("TIERGUARD_LLAMA_PYTHON"), str(ROOT / ".venv-llamacpp" / "bin" / "python"),
                  sys.executable]
    for py in filter(None, candidates):
        if Path(py).exists() and subprocess.run([py, "-c", "import llama_cpp.server.app"],
                                                capture_output=True).returncode == 0:
            return py
    pytest.skip("llama-cpp-python[server] is not installed (`make test` builds it into .venv-llamacpp)")


def llama_cpp_greedy(py: str, gguf: Path, prompts: list[list[int]], ours: list[list[int]], steps: int,
                     text: str) -> dict:
    job = {"gguf": str(gguf), "prompts": prompts, "ours": ours, "steps": steps, "text": text}
    res = subprocess.run([py, str(GREEDY_SCRIPT)], input=json.dumps(job), capture_output=True, text=True,
                         timeout=3000)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


STEPS = 64
# What holds between llama.cpp (its defaults: f16 KV cache) and our engine on SmolLM2:
# f32: the same float32 weights, sums in another order: every greedy sequence equal,
#   token for token (measured: 8 of 8, top-1 along ours 1.0).
# Q8_0: the same weights (our int8 layers take the file's blocks as they are), but
#   llama.cpp also rounds each activation row to 8 bits for its Q8_0 dot products, which
#   we do not: near-ties flip and greedy texts part within a few dozen tokens (measured:
#   1 of 8 equal, top-1 along ours 0.957). Asserted: top-1 along ours >= 0.9.
FORCED_MIN = {"f32": 1.0, "q8_0": 0.9}


@pytest.fixture(scope="module")
def smollm2_dir():
    from tierguard.model.registry import resolve_model, smollm2_gguf

    try:
        smollm2_gguf()
    except TierguardError as exc:
        pytest.skip(str(exc))
    return resolve_model("smollm2")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_llama_cpp_greedy_matches_ours_on_smollm2(dtype, smollm2_dir, tmp_path):
    """SmolLM2 exported by `tierguard model export-gguf --dtype f32|q8_0`, 8 chat prompts x
    64 greedy steps under llama.cpp, against our engine on the same file (float32 weights;
    for Q8_0 our int8 layers made of the file's own blocks)."""
    from tests.model.test_smollm2_parity import PROMPTS
    from tierguard.engine.api import SamplingParams
    from tierguard.engine.factory import build_engine
    from tierguard.model.registry import resolve_model

    py = llama_python()
    gguf_path = export_gguf(smollm2_dir, tmp_path / f"smollm2-{dtype}.gguf", dtype=dtype).path
    if dtype == "f32":
        engine = build_engine(smollm2_dir, dtype="float32", device="cpu", kv_cache_gib=0.1, max_model_len=512,
                              max_num_seqs=8)
    else:
        engine = build_engine(resolve_model(str(gguf_path)), dtype="float32", device="cpu", kv_cache_gib=0.1,
                              max_model_len=512, max_num_seqs=8, weight_dtype="int8", gguf_path=gguf_path)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    text = "The memory cache holds 1234 tokens; latency is 5.6 ms. Überprüfung: café, naïve."
    mine_text = tok.encode(text)  # special tokens as the model's tokenizer adds them
    engine.close()
    theirs = llama_cpp_greedy(py, gguf_path, prompts, ours, STEPS, text)
    equal = sum(a == b for a, b in zip(theirs["greedy"], ours, strict=True))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
              for a, b in zip(theirs["greedy"], ours, strict=True)]
    forced = sum(int(x == y) for a, b in zip(theirs["forced"], ours, strict=True) for x, y in zip(a, b, strict=True))
    agreement = forced / (len(prompts) * STEPS)
    print(f"llama.cpp {dtype}: {equal} of {len(prompts)} greedy sequences equal, first differences at {firsts}; "
          f"top-1 along ours {agreement:.4f}")
    assert theirs["tokenized"] == mine_text
    assert agreement >= FORCED_MIN[dtype]
    if FORCED_MIN[dtype] == 1.0:
        assert equal == len(prompts), firsts  # token for token


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tierguard_bench_against_real_llama_cpp_server(tmp_path):
    py = llama_python()
    from tierguard.model.tiny import ensure_tiny_model

    model_dir = ensure_tiny_model()
    gguf_path = export_gguf(model_dir, tmp_path / "tiny.gguf").path

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "llama_server.log"
    args = [py, "-m", "llama_cpp.server", "--model", str(gguf_path), "--host", "127.0.0.1",
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
