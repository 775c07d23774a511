"""Async jobs at rest: sealed with AES-256-GCM, owned by a key, deleted after their TTL."""

from __future__ import annotations

import os
import time

from tierguard.common.crypto import Key, KeyRing
from tierguard.gate.jobs import JobStore, owner_id
from tierguard.gate.policy import GateSettings, state_dir

SECRET = "my-diagnosis-is-confidential"


def _finish(store: JobStore, job, result: dict) -> None:
    job.status, job.http_status, job.result = "succeeded", 200, result
    store.save(job)


def test_sealed_files_hold_no_plaintext_and_only_the_right_keys_open_them(tmp_path):
    k1, k2 = Key(os.urandom(32)), Key(os.urandom(32))
    store = JobStore(tmp_path / "jobs", keyring=KeyRing(k1))
    job = store.create("/v1/completions", {"prompt": SECRET * 4}, 9, owner=owner_id("sk-a"))
    _finish(store, job, {"choices": [{"text": SECRET}]})
    path = tmp_path / "jobs" / f"{job.id}.job"
    raw = path.read_bytes()
    assert SECRET.encode() not in raw and b"prompt" not in raw and raw.startswith(b"TGE1")
    assert path.stat().st_mode & 0o077 == 0 and (tmp_path / "jobs").stat().st_mode & 0o777 == 0o700
    assert store.load(job.id).result == {"choices": [{"text": SECRET}]}
    assert store.load(job.id).owner == owner_id("sk-a") != owner_id("sk-b")
    # a restart with another key: the job is not served (and not deleted), counted
    wrong = JobStore(tmp_path / "jobs", keyring=KeyRing(k2))
    assert wrong.load(job.id) is None and wrong.undecryptable == 1 and path.exists()
    # a rotation: the new key writes, the old one still reads
    rotated = JobStore(tmp_path / "jobs", keyring=KeyRing(k2, [k1]))
    again = rotated.load(job.id)
    assert again.result == {"choices": [{"text": SECRET}]}
    rotated.save(again)
    assert KeyRing(k2).open(path.read_bytes(), b"tierguard job\x00" + job.id.encode())
    # a file copied under another job's name fails authentication: the id is associated data
    other = rotated.create("/v1/completions", {"prompt": "x"}, 1)
    (tmp_path / "jobs" / f"{other.id}.job").write_bytes(path.read_bytes())
    assert rotated.load(other.id) is None
    # without a key, the gate reads only plain files, and never these
    plain = JobStore(tmp_path / "jobs")
    assert plain.load(job.id) is None and plain.pending() == []


def test_results_are_deleted_after_the_ttl_pending_jobs_are_not(tmp_path):
    store = JobStore(tmp_path / "jobs", ttl_s=0.3)
    done = store.create("/v1/completions", {"prompt": "a"}, 1)
    _finish(store, done, {"ok": 1})
    waiting = store.create("/v1/completions", {"prompt": "b"}, 1)
    junk = tmp_path / "jobs" / ("job-" + "f" * 32 + ".job")  # another format: judged by age alone
    junk.write_bytes(b"TGE1 sealed by some other setup")
    assert store.sweep() == 0 and store.load(done.id) is not None
    old = time.time() - 1
    for p in (tmp_path / "jobs").iterdir():
        os.utime(p, (old, old))
    time.sleep(0.35)
    assert store.sweep() == 2 and store.expired == 2
    assert store.load(done.id) is None and not junk.exists()
    assert store.load(waiting.id).status == "queued"
    # between sweeps, an expired result is gone as soon as someone asks for it
    late = store.create("/v1/completions", {"prompt": "c"}, 1)
    _finish(store, late, {"ok": 2})
    time.sleep(0.35)
    assert store.load(late.id) is None and not (tmp_path / "jobs" / f"{late.id}.json").exists()


def test_default_jobs_dir_is_the_xdg_state_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert state_dir() == tmp_path / "state" / "tierguard"
    s = GateSettings(upstream="http://127.0.0.1:9").validate()
    assert s.jobs_dir == str(tmp_path / "state" / "tierguard" / "jobs")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the spec says: absolute paths only
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_dir() == tmp_path / "home" / ".local" / "state" / "tierguard"
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    JobStore(loose)
    assert loose.stat().st_mode & 0o777 == 0o700  # tightened, others keep out
