"""Config validation, context trimming and the on-disk job store."""

from __future__ import annotations

import asyncio
import json

import pytest

from tierguard.cli.main import main
from tierguard.common.errors import TierguardError
from tierguard.gate.jobs import JobStore
from tierguard.gate.policy import AdmissionPolicy, build_settings, load_config
from tierguard.gate.tokens import TokenCounter
from tierguard.gate.trim import can_trim, trim_messages


def test_toml_and_yaml_configs_load_with_flags_winning(tmp_path):
    toml = tmp_path / "g.toml"
    toml.write_text('upstream = "http://127.0.0.1:9"\n[policy]\nmax-long = 2\nlong_threshold = "4k"\n')
    yml = tmp_path / "g.yaml"
    yml.write_text("upstream: http://127.0.0.1:9\nmax_long: 2\nmax_queue_wait_ms: 500\n")
    assert load_config(str(toml))["max_long"] == 2
    s = build_settings({**load_config(str(yml)), "max_long": 3})
    assert s.policy.max_long == 3 and s.policy.max_queue_wait_ms == 500


@pytest.mark.parametrize("bad, words", [
    ({"max_long": 0}, "max_long"),
    ({"max_concurrency": 2.5}, "max_concurrency"),
    ({"overflow": "drop"}, "overflow"),
    ({"max_queue_wait_ms": -1}, "max_queue_wait_ms"),
    ({"upstream": "localhost:8000"}, "http"),
    ({"first_byte_timeout_s": 0}, "first_byte_timeout_s"),
])
def test_invalid_values_are_named(bad, words):
    with pytest.raises(TierguardError, match=words):
        build_settings({"upstream": "http://127.0.0.1:9", **bad})


def test_cli_rejects_bad_config_with_exit_2(tmp_path, capsys):
    cfg = tmp_path / "g.toml"
    cfg.write_text('upstream = "http://127.0.0.1:9"\nmax_lnog = 1\n')
    assert main(["gate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "max_lnog" in err and "Traceback" not in err
    assert main(["gate", "--upstream", "http://127.0.0.1:9", "--max-queue", "0"]) == 2
    assert "max_queue must be a positive whole number" in capsys.readouterr().err


def test_secret_in_config_is_refused(tmp_path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("upstream: http://127.0.0.1:9\napi_key: hunter2\n")
    assert main(["gate", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "api_key" in err


def test_policy_defaults_are_valid_and_match_the_documented_ones():
    import re

    from tierguard.cli.gate import _POLICY_FLAGS
    from tierguard.common.units import parse_tokens

    policy = AdmissionPolicy()
    assert policy.validate() is policy
    # `tierguard gate --help` states each default; the dataclass is what actually applies.
    documented = {flag.replace("-", "_"): m.group(1) for flag, (_type, text) in _POLICY_FLAGS.items()
                  if (m := re.search(r"\(default ([^)]+)\)", text))}
    assert documented.keys() >= {"max_concurrency", "long_threshold", "max_long", "max_queue", "max_queue_wait_ms"}
    for name, text in documented.items():
        assert getattr(policy, name) == parse_tokens(text, name), name
    # the documented invariant: max_long never exceeds max_concurrency after validate()
    assert AdmissionPolicy(max_concurrency=2, max_long=10).validate().max_long == 2


def _chat(n_turns: int, words: int = 20) -> list[dict]:
    msgs = [{"role": "system", "content": "sys " * 30}]
    for i in range(n_turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn{i} " + "w " * words})
    return msgs


def test_trim_drops_oldest_turns_keeps_system_and_last():
    msgs = _chat(9)
    counter = TokenCounter()
    full = asyncio.run(counter.count_chat(msgs))
    res = asyncio.run(trim_messages(msgs, full // 2, counter))
    assert res.fits and res.tokens <= full // 2 and res.dropped > 0
    assert res.messages[0]["role"] == "system" and res.messages[-1] is msgs[-1]
    kept = [m["content"].split()[0] for m in res.messages[1:]]
    assert kept == [m["content"].split()[0] for m in msgs[-len(kept):]]  # the newest turns, in order


def test_trim_reports_failure_when_required_turns_are_too_long():
    msgs = _chat(3)
    res = asyncio.run(trim_messages(msgs, 5, TokenCounter()))
    assert not res.fits and res.messages[0]["role"] == "system" and res.messages[-1] is msgs[-1]
    assert not can_trim([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert can_trim(_chat(2))


def test_job_store_atomic_states_and_restart(tmp_path):
    store = JobStore(tmp_path / "jobs")
    a = store.create("/v1/completions", {"prompt": "x"}, 3)
    b = store.create("/v1/completions", {"prompt": "y"}, 3)
    b.status = "running"
    store.save(b)
    c = store.create("/v1/completions", {"prompt": "z"}, 3)
    c.status, c.result = "succeeded", {"ok": 1}
    store.save(c)
    (tmp_path / "jobs" / ".job-cut.tmp").write_text("{half")  # a write cut off by a crash
    again = JobStore(tmp_path / "jobs")
    assert [j.id for j in again.pending()] == [a.id, b.id]
    assert not list((tmp_path / "jobs").glob("*.tmp"))
    assert again.load(c.id).result == {"ok": 1}
    assert "body" not in again.load(a.id).public()
    assert again.load("../etc/passwd") is None
    assert (tmp_path / "jobs" / f"{a.id}.json").stat().st_mode & 0o077 == 0
    json.loads((tmp_path / "jobs" / f"{a.id}.json").read_text())


def test_a_job_that_fails_unexpectedly_gives_its_slot_back(tmp_path):
    """The worker survives a bug in the upstream call (the job records it) and the slot is
    released: otherwise every such job would shrink the gate's concurrency for good."""
    from tierguard.gate.admission import AdmissionController
    from tierguard.gate.reqlog import RequestLog
    from tierguard.gate.runner import JobRunner

    class BrokenUpstream:
        async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
            raise RuntimeError("a bug, not an upstream failure")

    async def go():
        store = JobStore(tmp_path / "jobs")
        controller = AdmissionController(AdmissionPolicy(max_concurrency=1).validate())
        runner = JobRunner(store, controller, BrokenUpstream(), RequestLog(None), workers=1)
        await runner.start()
        job = store.create("/v1/completions", {"prompt": "x"}, 3)
        runner.submit(job)
        for _ in range(200):
            if store.load(job.id).status == "failed":
                break
            await asyncio.sleep(0.01)
        await runner.stop()
        return store.load(job.id), controller.stats()

    job, stats = asyncio.run(go())
    assert job.status == "failed" and "RuntimeError" in job.error
    assert sum(stats.in_flight.values()) == 0, stats.in_flight
