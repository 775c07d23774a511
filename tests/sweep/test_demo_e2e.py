"""`tierguard demo --quick` on the real engine: what CI runs as the README's main job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_quick_writes_the_report(tmp_path):
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "tierguard", "demo", "--quick", "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "boundary.json").read_text())
    variants = doc["variants"]
    assert {"reference", "small-pool"} <= set(variants)
    for name, v in variants.items():
        assert v["status"] == "done", (name, v)
        b = v["contexts"]["1024"]
        assert b is not None and b["evaluated"][0] == 1
    html = (out / "report.html").read_text()
    assert "Recommendation" in html and 'src="data:image/png;base64,' in html
    assert "Boundary" in res.stdout and "report:" in res.stdout

    naive, contract = variants.get("naive-sync-disk"), variants.get("small-pool-host-nvme")
    if naive and contract:  # present once `tierguard serve` has the disk-tier flags
        n = naive["contexts"]["1024"]["max_concurrency"] or 0
        c = contract["contexts"]["1024"]["max_concurrency"] or 0
        assert n <= c, "reading NVMe inside the decode loop should never hold the SLO longer"
