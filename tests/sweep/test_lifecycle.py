from __future__ import annotations

import json
import time

import pytest

from sweep.helpers import failing_variant, schedule_variant, stubborn_variant
from tierguard.sweep.lifecycle import Engine, EngineStartError, http_get
from tierguard.sweep.matrix import Profile, Variant


def test_start_health_warmup_version_and_clean_stop(tmp_path):
    eng = Engine(Variant(**schedule_variant("fast", capacity=2)), tmp_path / "fast")
    with eng.start(Profile()):
        assert http_get(f"{eng.base_url}/health")[0] == 200
        assert eng.model == "schedule-model"
        assert eng.info["warmup"] == {"sent": 1, "ok": 1}
        pid = eng.proc.pid
    info = json.loads((tmp_path / "fast" / "engine.json").read_text())
    assert info["version"]["version"] == "schedule-server-1"
    assert info["stop"] == "sigterm" and info["pid"] == pid
    assert "{port}" not in " ".join(info["command"])
    assert http_get(f"{eng.base_url}/health", timeout=1)[0] == 0  # really gone


def test_failed_start_names_exit_code_and_log_tail(tmp_path):
    eng = Engine(Variant(**failing_variant()), tmp_path / "broken")
    with pytest.raises(EngineStartError) as e:
        eng.start(Profile())
    assert "code 3" in str(e.value) and "cannot allocate KV" in str(e.value)
    assert (tmp_path / "broken" / "engine.log").read_text().strip() == "cannot allocate KV"


def test_missing_binary_and_health_timeout(tmp_path):
    with pytest.raises(EngineStartError, match="cannot run"):
        Engine(Variant(name="nobin", command="/nonexistent/engine --port {port}"), tmp_path / "a").start(
            Profile()
        )
    slow = Variant(
        name="silent", command=["python3", "-c", "import time; time.sleep(30)"], start_timeout_s=0.5
    )
    t0 = time.monotonic()
    eng = Engine(slow, tmp_path / "b")
    with pytest.raises(EngineStartError, match="within 0.5s"):
        eng.start(Profile())
    assert time.monotonic() - t0 < 10
    assert eng.proc.poll() is not None  # the failed engine was stopped, not leaked


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path):
    eng = Engine(Variant(**stubborn_variant()), tmp_path / "s")
    eng.start(Profile())
    eng.stop()
    assert eng.info["stop"] == "sigkill"
    assert eng.proc.returncode == -9
