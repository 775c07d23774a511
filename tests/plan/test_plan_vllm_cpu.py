"""`--engine vllm --target cpu`: vLLM's CPU pool arithmetic, against lines vLLM 0.32 logged.

The logged lines below were read off real vLLM-CPU start-ups (tests/vllm checks the same
against a live engine in the slow suite); here the arithmetic and the error paths.
"""

from __future__ import annotations

import json

import pytest

from tierguard.cli.main import main as tierguard_main
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan.config import parse_config
from tierguard.plan.inputs import PlanInputs
from tierguard.plan.planner import make_plan


def _llama(layers: int, hidden: int, heads: int, kv: int, dtype: str = "float32", mpe: int = 2048, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": 4 * hidden, "vocab_size": 512, "max_position_embeddings": mpe,
            "torch_dtype": dtype, **extra}


SMOLLM2 = _llama(30, 576, 9, 3, mpe=8192, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def _plan(cfg: dict, **kw) -> dict:
    return make_plan(PlanInputs(model=parse_config(cfg, name="m"), engine="vllm", target="cpu", **kw))


@pytest.mark.parametrize(
    "cfg,kw,line",
    [
        (SMOLLM2, dict(kv_cache_gib=1, weights_dtype="float32", max_model_len=4096),
         "CPU KV cache size: 23,296 tokens, Maximum concurrency for 4,096 tokens per request: 5.69x"),
        (_llama(3, 256, 8, 8), dict(kv_cache_gib=1),
         "CPU KV cache size: 349,440 tokens, Maximum concurrency for 2,048 tokens per request: 170.62x"),
        (_llama(2, 1024, 4, 1), dict(kv_cache_gib=0.3, weights_dtype="float32", max_model_len=1000),
         "CPU KV cache size: 76,750 tokens, Maximum concurrency for 1,000 tokens per request: 76.75x"),
        (_llama(5, 480, 6, 3), dict(kv_cache_gib=1, weights_dtype="bfloat16", block_size=64),
         "CPU KV cache size: 223,680 tokens, Maximum concurrency for 2,048 tokens per request: 109.22x"),
        (_llama(7, 576, 6, 2), dict(kv_cache_gib=1, weights_dtype="float16", max_model_len=1500, kv_dtype="fp8"),
         "CPU KV cache size: 390,000 tokens, Maximum concurrency for 1,500 tokens per request: 260.00x"),
    ],
)
def test_predicts_the_line_vllm_logged(cfg, kw, line):
    assert _plan(cfg, **kw)["vllm_cpu"]["log_line"] == line


def test_float32_checkpoint_is_served_in_bfloat16_unless_asked():
    auto, f32 = _plan(SMOLLM2, kv_cache_gib=1), _plan(SMOLLM2, kv_cache_gib=1, weights_dtype="float32")
    assert auto["vllm_cpu"]["dtype"] == "bfloat16" and f32["vllm_cpu"]["dtype"] == "float32"
    assert f32["vllm_cpu"]["bytes_per_token"] == 46_080 == 2 * auto["vllm_cpu"]["bytes_per_token"]
    assert auto["vllm_cpu"]["max_model_len"] == 8192  # the config's max_position_embeddings, as vLLM takes it


def test_whole_gib_goes_in_the_env_and_a_fraction_in_bytes():
    whole = _plan(SMOLLM2, kv_cache_gib=2)
    assert whole["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2" and "--kv-cache-memory-bytes" not in whole["flags"]["vllm"]
    assert whole["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    part = _plan(SMOLLM2, kv_cache_gib=0.25)
    flags = part["flags"]["vllm"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in part["env"]  # it takes whole GiB only
    assert int(flags[flags.index("--kv-cache-memory-bytes") + 1]) == GIB // 4 == part["vllm_cpu"]["kv_cache_bytes"]


def test_a_pool_too_small_for_one_request_is_named():
    p = _plan(SMOLLM2, kv_cache_gib=0.05, weights_dtype="float32")  # 9 blocks of 128 tokens
    fig = p["vllm_cpu"]
    assert not fig["starts"] and not p["fits"]
    assert fig["longest_max_model_len"] == (fig["num_blocks"] - 1) * 128
    assert "refuse to start" in p["warnings"][0]
    ok = _plan(SMOLLM2, kv_cache_gib=0.05, weights_dtype="float32", max_model_len=fig["longest_max_model_len"])
    assert ok["vllm_cpu"]["starts"]


@pytest.mark.parametrize(
    "cfg,kw,needle",
    [
        (SMOLLM2, dict(), "needs --kv-cache-gib"),
        (SMOLLM2, dict(kv_cache_gib=1, block_size=16), "multiples of 32"),
        (SMOLLM2, dict(kv_cache_gib=1, weights_dtype="int8"), "float32, bfloat16 or float16"),
        (SMOLLM2, dict(kv_cache_gib=1, kv_dtype="int8"), "auto, fp8"),
        (_llama(5, 480, 6, 3), dict(kv_cache_gib=1, kv_dtype="fp8"), "divisible by 32"),
        (_llama(4, 256, 8, 2, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2,
                model_type="gemma3_text", architectures=["Gemma3ForCausalLM"]), dict(kv_cache_gib=1), "full attention"),
    ],
)
def test_refuses_what_it_cannot_mirror(cfg, kw, needle):
    with pytest.raises(TierguardError, match=needle):
        _plan(cfg, **kw)


def test_kv_cache_gib_belongs_to_vllm_on_cpu():
    with pytest.raises(TierguardError, match="--engine vllm --target cpu"):
        make_plan(PlanInputs(model=parse_config(SMOLLM2, name="m"), gpu="L4", kv_cache_gib=1))


def test_cli_json_gives_both_figures_as_numbers(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert tierguard_main(["plan", "--model", str(tmp_path), "--engine", "vllm", "--target", "cpu",
                           "--kv-cache-gib", "1", "--dtype", "float32", "--max-model-len", "4096", "--json"]) == 0
    fig = json.loads(capsys.readouterr().out)["vllm_cpu"]
    assert fig["kv_cache_tokens"] == 23_296 and fig["max_concurrency"] == 5.6875
    assert tierguard_main(["plan", "--model", str(tmp_path), "--engine", "vllm", "--target", "cpu",
                           "--kv-cache-gib", "1"]) == 0
    text = capsys.readouterr().out
    assert "CPU KV cache size: 46,592 tokens" in text and "VLLM_CPU_KVCACHE_SPACE=1" in text


def test_fp8_kv_on_a_cpu_without_avx512_or_amx_is_named(tmp_path, monkeypatch):
    from tierguard.plan import vllm_cpu

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    zen4 = tmp_path / "zen4"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16\n")
    assert not vllm_cpu.cpu_holds_fp8_kv(str(avx2)) and vllm_cpu.cpu_holds_fp8_kv(str(zen4))
    assert vllm_cpu.cpu_holds_fp8_kv(str(tmp_path / "missing"))  # unreadable: no guess against the plan
    fp8 = dict(kv_cache_gib=1, weights_dtype="float16", max_model_len=1500, kv_dtype="fp8")
    monkeypatch.setattr("tierguard.plan.planner.cpu_holds_fp8_kv", lambda: vllm_cpu.cpu_holds_fp8_kv(str(avx2)))
    warned = _plan(_llama(7, 576, 6, 2), **fp8)["warnings"]
    assert any("AVX-512 or AMX" in w and "refuses to start" in w for w in warned), warned
    assert not any("AVX-512" in w for w in _plan(_llama(7, 576, 6, 2), **{**fp8, "kv_dtype": "auto"})["warnings"])
    monkeypatch.setattr("tierguard.plan.planner.cpu_holds_fp8_kv", lambda: vllm_cpu.cpu_holds_fp8_kv(str(zen4)))
    assert not any("AVX-512" in w for w in _plan(_llama(7, 576, 6, 2), **fp8)["warnings"])
