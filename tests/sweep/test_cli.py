from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tierguard", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("variants: []\nslo: {p99_ttft_ms: 1, p99_itl_ms: 1}\n")
    res = cli("sweep", str(bad), "--run-dir", str(tmp_path / "r"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "at least one variant" in res.stderr
    res = cli("report", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "is not a directory" in res.stderr


def test_unwritable_output_directories_fail_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    example = Path(__file__).resolve().parents[2] / "examples" / "tierguard-serve.yaml"
    res = cli("sweep", str(example), "--run-dir", str(blocker / "run"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--run-dir" in res.stderr and "cannot be created" in res.stderr
    res = cli("demo", "--output-dir", str(blocker / "out"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--output-dir" in res.stderr and "cannot be created" in res.stderr
