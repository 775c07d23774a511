"""plan --kvcheck: the kv_quantization step names the check, and a result validates or
rejects it (a rejected quantization is taken out of the plan)."""

from __future__ import annotations

import json
import subprocess
import sys

ARGS = ["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "L40S", "--kv-dtype", "fp16",
        "--context", "32k", "--concurrency", "8", "--host-ram-gib", "256", "--json"]  # fmt: skip


def _plan(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierguard", *ARGS, *extra], capture_output=True, text=True, timeout=60)


def _step(doc: dict) -> dict:
    return next(s for s in doc["ladder"] if s["step"] == "kv_quantization")


def _result(tmp_path, passed: bool):
    path = tmp_path / f"kvcheck-{passed}.json"
    verdict = {"passed": passed, "failed_contexts": [] if passed else [8192]}
    path.write_text(json.dumps({"format": "tierguard-kvcheck/1", "model": "smollm2", "contexts": [1024, 8192],
                                "verdicts": {"fp8": verdict, "int8": {"passed": True, "failed_contexts": []}}}))  # fmt: skip
    return str(path)


def test_step_points_to_the_check(tmp_path):
    res = _plan()
    assert res.returncode == 0, res.stderr
    step = _step(json.loads(res.stdout))
    assert step["applied"] and step["kvcheck"]["status"] == "unchecked"
    assert step["kvcheck"]["command"].startswith("tierguard kvcheck --model meta-llama/Llama-3.1-8B --kv-dtype fp8")
    assert "--contexts 32k" in step["kvcheck"]["command"] and "check it: tierguard kvcheck" in step["detail"]


def test_passing_result_validates_and_failing_one_rejects(tmp_path):
    ok = json.loads(_plan("--kvcheck", _result(tmp_path, True)).stdout)
    assert _step(ok)["kvcheck"]["status"] == "validated" and _step(ok)["applied"]
    bad = _plan("--kvcheck", _result(tmp_path, False))
    assert bad.returncode == 0, bad.stderr
    doc = json.loads(bad.stdout)
    step = _step(doc)
    assert step["kvcheck"]["status"] == "rejected" and not step["applied"]
    assert "rejected by kvcheck" in step["detail"] and doc["final"]["kv_dtype"] != "fp8"
    assert [s["step"] for s in doc["ladder"]][-1] != "kv_quantization"  # the ladder went on


def test_bad_result_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    (tmp_path / "y.json").write_text(json.dumps({"hello": 1}))
    for name, words in (("x.json", "is not JSON"), ("y.json", "is not a `tierguard kvcheck"), ("z.json", "cannot read")):
        res = _plan("--kvcheck", str(tmp_path / name))
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
