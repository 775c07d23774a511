"""A matrix (or config, or trace) file that is not UTF-8 is bad input like any other: one
line naming the file and the first bad byte, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierguard.common.errors import TierguardError, read_text

LATIN1 = "name: caf\xe9\nvariants: []\n".encode("latin-1")  # é as one byte 0xe9: not UTF-8


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierguard", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", [["sweep"], ["predict"], ["gate", "--upstream", "http://127.0.0.1:9", "--config"]],
                         ids=["sweep", "predict", "gate-config"])
def test_a_non_utf8_file_is_one_line_and_exit_2(tmp_path, command):
    bad = tmp_path / "matrix.yaml"
    bad.write_bytes(LATIN1)
    res = cli(*command, str(bad))
    err = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert "is not UTF-8 text (byte 0xe9 at offset 9)" in err and str(bad) in err


def test_read_text_names_what_and_why(tmp_path):
    good = tmp_path / "ok.yaml"
    good.write_text("name: café\n", encoding="utf-8")
    assert read_text(good, "matrix file") == "name: café\n"
    with pytest.raises(TierguardError, match=r"^cannot read --trace '.*absent'"):
        read_text(tmp_path / "absent", "--trace")
    with pytest.raises(TierguardError, match=r"^--trace '.*is not UTF-8 text"):
        (tmp_path / "t.jsonl").write_bytes(b'{"a": 1}\n\xff\n')
        read_text(tmp_path / "t.jsonl", "--trace")
