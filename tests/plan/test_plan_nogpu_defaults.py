"""Configs as users have them (transformers defaults, said out loud), planning without a GPU,
and `--target cpu` for `tierguard serve` on this machine."""

from __future__ import annotations

import json

import pytest

from tierguard.cli.main import main
from tierguard.common.errors import TierguardError
from tierguard.common.units import GIB
from tierguard.plan import PlanInputs, make_plan, parse_config

from .conftest import llama_like

GEMMA3_TEXT = {  # a Gemma-3 checkpoint's config: the text model nested, vocab_size left out
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "head_dim": 128,
    },
    "torch_dtype": "bfloat16",
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_gemma3_text_config_gets_transformers_defaults_and_says_so():
    spec = parse_config(GEMMA3_TEXT, "g3")
    assert spec.family == "gemma3_text"
    assert spec.vocab_size == 262208 and spec.tie_embeddings
    assert spec.defaulted["vocab_size"] == 262208 and spec.defaulted["sliding_window_pattern"] == 6
    # Five local layers, then one global: 10 of 62 layers keep the whole context.
    assert spec.count("full") == 10 and spec.count("sliding") == 52 and spec.sliding_window == 4096


def test_given_fields_win_and_explicit_null_is_kept():
    spec = parse_config(llama_like(), "llama")
    assert spec.defaulted == {"rope_theta": 10000.0}
    mistral = parse_config(
        {
            "architectures": ["MistralForCausalLM"],
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "intermediate_size": 14336,
            "sliding_window": None,
        },
        "m",
    )
    # vocab and KV heads come from MistralConfig; the explicit null window stays off.
    assert mistral.vocab_size == 32000 and mistral.num_kv_heads == 8
    assert mistral.sliding_window is None and "sliding_window" not in mistral.defaulted


def test_core_dimensions_are_never_defaulted():
    raw = llama_like(hidden_size=None)
    with pytest.raises(TierguardError, match="lacks required field 'hidden_size'"):
        parse_config(raw, "x")


def test_plan_without_gpu_counts_what_needs_no_gpu():
    p = make_plan(PlanInputs(model="Qwen/Qwen3-32B", tp=2, host_ram_gib=64))
    assert p["gpu"] is None and p["fits"] is None and "--gpu" in p["gpu_needed"]
    assert p["kv"]["bytes_per_token"] == 64 * 8 * 128 * 2 * 2
    by = p["weights_by_dtype"]
    assert set(by) == {"bf16", "fp8", "int8", "int4"}
    assert by["bf16"]["per_gpu_bytes"] == pytest.approx(by["bf16"]["total_bytes"] / 2, rel=0.02)
    assert by["int4"]["total_bytes"] < by["fp8"]["total_bytes"] < by["bf16"]["total_bytes"]
    assert p["host"]["usable_bytes"] > 0


def test_cli_without_gpu_on_a_model_directory(tmp_path, capsys):
    d = tmp_path / "gemma3-27b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GEMMA3_TEXT))
    code, out, err = run(capsys, "--model", str(d), "--host-ram-gib", "64", "--context", "8k")
    assert code == 0, err
    assert "Weights per dtype" in out and "defaulted" in out and "vocab_size=262208" in out
    assert out.strip().splitlines()[-1].startswith("GPU capacity needs --gpu")
    code, out, _ = run(capsys, "--model", str(d), "--host-ram-gib", "64", "--json")
    assert code == 0 and json.loads(out)["gpu"] is None


def test_target_cpu_plans_tierguard_serve_in_ram():
    p = make_plan(
        PlanInputs(model="Qwen/Qwen3-0.6B", target="cpu", host_ram_gib=32, contexts=[8192], concurrency=4)
    )
    g = p["gpu"]
    assert p["engine"] == "tierguard" and set(p["flags"]) == {"tierguard"}
    flags = p["flags"]["tierguard"]
    assert flags[:2] == ["--device", "cpu"]
    assert g["budget_bytes"] == p["host"]["usable_bytes"] < g["total_bytes"] == 32 * GIB
    assert g["non_torch_bytes"] == 0 and p["settings"]["max_num_batched_tokens"] == 512
    need = p["workload"]["kv_bytes_per_gpu"]
    asked = float(flags[flags.index("--kv-cache-gib") + 1]) * GIB
    assert need <= asked <= need + 0.02 * GIB  # what the workload needs, not all free RAM


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(model="openai/gpt-oss-20b"), "mxfp4"),
        (dict(model="Qwen/Qwen3-0.6B", gpu="L4"), "drop --gpu"),
        (dict(model="Qwen/Qwen3-0.6B", engine="sglang"), "runs on GPUs"),
        (dict(model="Qwen/Qwen3-0.6B", engine="vllm"), "needs --kv-cache-gib"),
        (dict(model="Qwen/Qwen3-0.6B", tp=2), "must be 1"),
    ],
)
def test_target_cpu_refuses_what_tierguard_serve_cannot_do(kwargs, needle):
    with pytest.raises(TierguardError, match=needle):
        make_plan(PlanInputs(target="cpu", host_ram_gib=32, **kwargs))


# int8: 1 + 2/32 bytes per weight (a float16 scale per 32) over float32's 4 = 0.266 (the
# norms stay float); a per-channel scale alone would be 0.25
@pytest.mark.parametrize("dtype,low,ratio", [("int8", 0.265, 0.275), ("int4", 0.15, 0.2)])
def test_target_cpu_counts_serves_quantized_weights(dtype, low, ratio):
    """--weights-dtype int8/int4 with --target cpu: tierguard serve's own formats (int8
    groups of 32 with a float16 scale; int4 groups of 32 with float16 scale and min, the
    embedding int8), and the flag to pass."""
    base = dict(model="Qwen/Qwen3-0.6B", target="cpu", host_ram_gib=32, contexts=[8192], concurrency=4)
    fp = make_plan(PlanInputs(weights_dtype="fp32", **base))
    q = make_plan(PlanInputs(weights_dtype=dtype, **base))
    assert q["weights_bytes"] < ratio * fp["weights_bytes"]
    assert q["weights_bytes"] > low * fp["weights_bytes"]
    flags = q["flags"]["tierguard"]
    assert flags[flags.index("--weight-dtype") + 1] == dtype
    assert "--weight-dtype" not in fp["flags"]["tierguard"]
    assert q["gpu"]["kv_available_bytes_per_gpu"] > fp["gpu"]["kv_available_bytes_per_gpu"]  # the bytes saved
