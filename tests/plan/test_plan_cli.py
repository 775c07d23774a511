"""`tierguard plan` end to end: the --json contract, the table, and bad input -> one line, exit 2."""

from __future__ import annotations

import json

import pytest

from tierguard.cli.main import main

from .conftest import llama_like


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract_keys(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        "Llama-3.1-8B",
        "--gpu",
        "H100-80GB",
        "--kv-dtype",
        "fp16",
        "--context",
        "2k,32k",
        "--concurrency",
        "8",
        "--host-ram-gib",
        "128",
        "--json",
    )
    assert code == 0
    plan = json.loads(out)
    for key in (
        "model",
        "kv",
        "weights_bytes",
        "weights_bytes_per_gpu",
        "gpu",
        "max_concurrency",
        "fits",
        "host",
        "ladder",
        "flags",
    ):
        assert key in plan
    kv = plan["kv"]
    assert kv["dtype"] == "fp16" and kv["bytes_per_token"] == 131072
    assert isinstance(kv["bytes_per_token_per_gpu"], int)
    assert kv["per_sequence_bytes"] == {"2048": 2048 * 131072, "32768": 4 * 1024**3}
    for key in ("budget_bytes", "kv_available_bytes_per_gpu", "kv_capacity_tokens"):
        assert isinstance(plan["gpu"][key], int)
    assert set(plan["max_concurrency"]) == {"2048", "32768"}
    assert isinstance(plan["fits"], bool)
    assert set(plan["flags"]) == {"vllm", "sglang", "llamacpp", "tierguard"}
    assert all(isinstance(f, str) for flags in plan["flags"].values() for f in flags)


def test_table_output_names_the_parts(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        "Qwen/Qwen3-8B",
        "--gpu",
        "L4",
        "--context",
        "8k,32k",
        "--concurrency",
        "4",
        "--host-ram-gib",
        "64",
    )
    assert code == 0
    for text in (
        "KV per token",
        "activation peak",
        "GPU KV cache size",
        "Remedy ladder",
        "vllm:",
        "tierguard:",
    ):
        assert text in out


def test_config_path_and_directory(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(llama_like()))
    code, out, _ = run(
        capsys, "--model", str(tmp_path / "m"), "--gpu-mem-gib", "80", "--host-ram-gib", "64", "--json"
    )
    assert code == 0 and json.loads(out)["kv"]["bytes_per_token"] == 131072
    code, out, _ = run(
        capsys,
        "--model",
        "m",
        "--model-dir",
        str(tmp_path),
        "--gpu",
        "A100-80GB",
        "--host-ram-gib",
        "64",
        "--json",
    )
    assert code == 0 and json.loads(out)["model"]["name"] == "m"


def _bad_config(tmp_path) -> str:
    raw = llama_like()
    del raw["num_key_value_heads"], raw["hidden_size"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(raw))
    return str(path)


BAD = [
    (["--model", "Llama-3.1-8B", "--gpu", "TPU-v5"], "unknown GPU"),
    (["--model", "no-such-model", "--gpu", "L4"], "unknown model"),
    (["--model", "Llama-3.1-8B", "--gpu-mem-gib", "-8"], "--gpu-mem-gib"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--host-ram-gib", "0"], "--host-ram-gib"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--tp", "0"], "--tp"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--concurrency", "-2"], "--concurrency"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--context", "0"], "--context"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--context", "256k"], "max_position_embeddings"),
    (
        ["--model", "Llama-3.1-8B", "--gpu", "L4", "--gpu-memory-utilization", "1.5"],
        "--gpu-memory-utilization",
    ),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--kv-dtype", "fp7"], "unknown KV dtype"),
    (["--model", "Llama-3.1-8B", "--gpu", "L4", "--block-size", "abc"], "--block-size"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    code, out, err = (
        run(capsys, *argv, "--host-ram-gib", "64") if "--host-ram-gib" not in argv else run(capsys, *argv)
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err
    assert out == ""


def test_config_missing_field_names_it(tmp_path, capsys):
    code, _, err = run(capsys, "--model", _bad_config(tmp_path), "--gpu", "L4", "--host-ram-gib", "64")
    assert code == 2 and "hidden_size" in err and len(err.strip().splitlines()) == 1


def test_invalid_json_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    code, _, err = run(capsys, "--model", str(path), "--gpu", "L4", "--host-ram-gib", "64")
    assert code == 2 and "not valid JSON" in err
