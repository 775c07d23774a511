"""kvcheck: prompts, the verdict against the baseline, exact reuse of work, the CLI."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierguard.kvcheck import runner as kr
from tierguard.kvcheck.inputs import ANSWER_TOKENS, PromptBuilder, answer_correct, load_text
from tierguard.kvcheck.verdict import Thresholds, rows, verdicts
from tierguard.model.tiny import create_tiny
from tierguard.model.tokenizer import HFTokenizer

SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=600, max_position_embeddings=512, seed=2)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("kvcheck-tiny"), **SMALL)


@pytest.fixture(scope="module")
def builder(small_dir) -> PromptBuilder:
    return PromptBuilder(HFTokenizer(small_dir), load_text().text, 512)


def test_trials_are_exact_length_seeded_and_share_the_haystack(builder):
    trials = builder.trials(256, 20, seed=0, answer_tokens=10)
    again = builder.trials(256, 20, seed=0, answer_tokens=10)
    assert [t.key for t in trials] == [t.key for t in again] and len({t.key for t in trials}) > 15
    assert [t.key for t in builder.trials(256, 20, seed=1)] != [t.key for t in trials]
    hay = builder.haystack_ids(512)
    for i, t in enumerate(trials):
        assert len(t.prompt) == 256 - 10
        assert i / 20 <= t.depth < (i + 1) / 20  # stratified depths
        k = len(builder.head) + int(t.depth * 0)  # the prefix up to the needle is the haystack
        common = next(j for j, (a, b) in enumerate(zip(t.prompt, hay, strict=False)) if a != b)
        assert common >= k
        assert builder.tok.decode(t.prompt).count(t.key) == 2  # the needle says it twice


def test_answer_is_the_first_number():
    assert answer_correct(" 48213. Remember it.", "48213")
    assert not answer_correct(" 4821 3", "48213") and not answer_correct(" none", "48213")
    assert not answer_correct(" 482135", "48213")


def _fake_runs(acc: dict[str, float], nll_shift: dict[str, float], n: int = 1024):
    runs, stats = {}, kr.PositionStats({}, {}, {})
    for name in acc:
        run = kr.DtypeRun(name, torch.empty(0))
        correct = int(round(acc[name] * 20 / 100))
        run.trials = [kr.TrialResult(1024, i, i / 20, "1", "", i < correct) for i in range(20)]
        runs[name] = run
        stats.nll[name] = torch.full((n,), 2.0 + nll_shift[name], dtype=torch.float64)
        stats.top1[name] = torch.zeros(n, dtype=torch.long)
        stats.max_logit_err[name] = torch.full((n,), 0.5)
    return runs, stats


@pytest.mark.parametrize(
    ("acc", "shift", "passed"),
    [
        ((90, 85), 0.0, True),  # 5 points: at the limit
        ((90, 80), 0.0, False),  # 10 points
        ((0, 0), 0.0, True),  # the bar is relative: no drop from a baseline that fails too
        ((90, 90), 0.0198, True),  # ppl x e^0.0198 = +2.0%
        ((90, 90), 0.03, False),  # +3.0%
    ],
)
def test_verdict_is_relative_to_the_baseline(acc, shift, passed):
    runs, stats = _fake_runs({"auto": acc[0], "int8": acc[1]}, {"auto": 0.0, "int8": shift})
    table = rows(runs, stats, [1024], Thresholds(5.0, 2.0))
    q = next(r for r in table if r["kv_dtype"] == "int8")
    assert q["passed"] is passed
    assert q["accuracy_drop_points"] == pytest.approx(acc[0] - acc[1])
    assert q["positions"] == 1023 - 512
    assert verdicts(table)["int8"] == {"passed": passed, "failed_contexts": [] if passed else [1024]}


def test_one_teacher_pass_serves_every_context_exactly(small_dir, builder):
    """The first L positions of the long pass are a pass over L tokens (causal attention,
    same chunk boundaries); and a trial answered after the cached haystack equals a cold one."""
    torch.manual_seed(0)
    ids = builder.teacher_ids(400)
    long = kr.DtypeSession(small_dir, "int8", 512, chunk=64, threads=1)
    short = kr.DtypeSession(small_dir, "int8", 512, chunk=64, threads=1)
    try:
        long.teacher(ids)
        short.teacher(ids[:200])
        assert torch.equal(long.run.hidden[:192], short.run.hidden[:192])  # same chunks: every bit
        # the short pass's last chunk is 8 tokens, not 64: same values up to matmul blocking
        torch.testing.assert_close(long.run.hidden[:200], short.run.hidden, atol=1e-5, rtol=1e-5)
        trial = builder.trials(384, 1, seed=3, answer_tokens=ANSWER_TOKENS)[0]
        long.warm(builder.haystack_ids(500))
        long.trials([trial], builder.tok.decode)
        short.trials([trial], builder.tok.decode)  # no haystack cached here
        assert long.run.trials[0].answer == short.run.trials[0].answer
    finally:
        long.close()
        short.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierguard", *args], capture_output=True, text=True, timeout=300)


def test_cli_runs_and_writes_json_table_and_plot(small_dir, tmp_path):
    out = tmp_path / "kv"
    res = _cli("kvcheck", "--model", str(small_dir), "--contexts", "256,512", "--trials", "2",
               "--threads", "1", "--output-dir", str(out), "--json")  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    doc = json.loads(res.stdout)
    assert doc == json.loads((out / "kvcheck.json").read_text())
    assert (out / "kvcheck.png").stat().st_size > 1000 and "| 512 | fp8 |" in (out / "kvcheck.md").read_text()
    assert doc["complete"] and doc["contexts"] == [256, 512] and doc["prefill_chunk"] == 64
    assert {(r["context"], r["kv_dtype"]) for r in doc["results"]} == {
        (c, d) for c in (256, 512) for d in ("auto", "int8", "fp8")
    }
    assert res.returncode == (0 if doc["passed"] else 1)
    for r in doc["results"]:
        if r["kv_dtype"] != "auto":
            # quantized reads are seen: not bit-identical to the baseline, but close
            assert 0 < r["max_logit_error"] < 5 and 0.5 < r["top1_agreement"] <= 1
    assert len(doc["trials"]["fp8"]) == 4 and doc["text"]["name"] == "debian-common-licenses"

    # the sweep report's real-model section reads the same file
    from tierguard.kvcheck.check import report_section

    assert report_section(tmp_path) is None
    (tmp_path / "kvcheck").mkdir()
    (tmp_path / "kvcheck" / "kvcheck.json").write_text((out / "kvcheck.json").read_text())
    table, (caption, png) = report_section(tmp_path)
    assert [r[:2] for r in table.rows][:3] == [["256", "baseline"], ["256", "int8"], ["256", "fp8"]]
    assert "Verdict: int8" in table.note and png[:4] == b"\x89PNG"


def test_exit_code_follows_the_verdict(monkeypatch, tmp_path):
    from tierguard.cli import kvcheck

    doc = {"passed": False, "complete": True, "contexts": [1024], "verdicts": {}}
    monkeypatch.setattr("tierguard.kvcheck.check.run_check", lambda spec, checkpoint=None: doc)
    monkeypatch.setattr("tierguard.model.registry.check_model_spec", lambda spec: None)
    args = argparse.Namespace(model="x", kv_dtype="int8", contexts="1k", trials=20, seed=0, text=None,
                              max_accuracy_drop=5.0, max_ppl_increase=2.0, device="cpu", threads=None,
                              chunk=None, json=True, output_dir=None)  # fmt: skip
    assert kvcheck.run(args) == 1
    doc["passed"] = True
    assert kvcheck.run(args) == 0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kv-dtype", "int4"], "--kv-dtype takes int8, fp8"),
        (["--contexts", "64"], "at least 128"),
        (["--contexts", "1k"], "exceeds the model's limit of 512"),
        (["--trials", "-1"], "--trials must be >= 0"),
        (["--text", "/no/such/file"], "--text '/no/such/file' is not a file"),
        (["--chunk", "1000"], "--chunk must be"),
    ],
)
def test_bad_input_is_one_line_exit_2(small_dir, argv, words, capsys):
    from tierguard.cli.main import main

    assert main(["kvcheck", "--model", str(small_dir), "--contexts", "256", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_missing_model_files_are_one_line(tmp_path, capsys):
    from tierguard.cli.main import main

    assert main(["kvcheck", "--model", str(tmp_path / "none.gguf")]) == 2
    assert "GGUF file does not exist" in capsys.readouterr().err
