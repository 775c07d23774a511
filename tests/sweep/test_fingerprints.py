from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierguard.sweep.cells import read_fingerprint


@pytest.mark.parametrize("text", ["[1, 2]", "not json", '"a string"'])
def test_read_fingerprint_ignores_run_json_that_is_not_an_object(tmp_path: Path, text: str):
    # A foreign or damaged run.json must not crash the sweep or the report.
    (tmp_path / "run.json").write_text(text)
    assert read_fingerprint(tmp_path) is None


def test_read_fingerprint_reads_both_key_names_and_nested_hash(tmp_path: Path):
    assert read_fingerprint(tmp_path) is None  # no run.json at all
    (tmp_path / "run.json").write_text(json.dumps({"profile_fingerprint": "abc"}))
    assert read_fingerprint(tmp_path) == "abc"
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": {"sha256": "def"}}))
    assert read_fingerprint(tmp_path) == "def"
