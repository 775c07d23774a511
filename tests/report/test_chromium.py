"""The report opens in a real headless browser: no console errors, every plot decoded."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tierguard.report import write_report

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason="headless test needs /usr/bin/chromium (apt-get install -y chromium)",
    ),
]


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def console_errors(stderr: str) -> list[str]:
    """Console messages Chromium logged at warning/error level, or uncaught exceptions."""
    out = []
    for line in stderr.splitlines():
        if "CONSOLE" in line and re.search(r":(ERROR|WARNING):", line):
            out.append(line)
        elif "Uncaught" in line:
            out.append(line)
    return out


def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    files = write_report(run_dir, tmp_path / "out")
    url = files.html.resolve().as_uri()
    dom = chromium(tmp_path / "profile1", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom.stdout)
    assert body, dom.stdout[:500]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
    assert int(attrs["plots-total"]) == len(files.plots) >= 6
    assert attrs["plots-rendered"] == attrs["plots-total"], "a plot did not decode"
    assert attrs["errors"] == "0"
    assert console_errors(dom.stderr) == []

    shot = tmp_path / "report.png"
    res = chromium(tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,2400", url)
    assert res.returncode == 0 and shot.stat().st_size > 20_000
    assert console_errors(res.stderr) == []
    keep = os.environ.get("TIERGUARD_TEST_ARTIFACTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report-screenshot.png")
        shutil.copy(files.html, Path(keep) / "report.html")
