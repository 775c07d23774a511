from __future__ import annotations

import subprocess
import sys


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
    assert res.returncode == 2 and "does not exist" in res.stderr
