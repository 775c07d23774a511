"""The disk tier after disk full, a directory not writable or an error streak: writes are
suspended, probed on the tier's own thread, and resumed once a probe succeeds; and old
fingerprints' directories count against the budget and go first, oldest first.

The waits below poll the tier's own counters (a hang guard, not a time bound)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading

import pytest

from tierguard.kv.faults import FaultInjector
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier

from .conftest import FP, payload, wait_until

N = 4096
PER = N + fmt.HEADER_LEN
OLD = "fedcba9876543210"


class ThreadsSeen(FaultInjector):
    """A fault injector that records which thread reached each disk write."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def check(self, op: str) -> None:
        if op == "disk.write":
            self.threads.append(threading.current_thread().name)
        super().check(op)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_writes_resume_after_a_probe_succeeds_counted(tmp_path, err):
    faults = ThreadsSeen()
    tier = DiskTier(tmp_path, FP, 1 << 20, faults=faults, probe_interval_s=0.01)
    try:
        faults.fail("disk.write", err, times=3)  # the write, then two probes fail: the cause lasts
        assert not tier.write(1, payload(1, N))
        s = tier.stats()
        assert not s.healthy and not s.writes_enabled and s.writes_disabled == 1
        assert "writes disabled until a probe write succeeds" in s.reason
        wait_until(lambda: tier.stats().writes_reenabled == 1, timeout=120)
        s = tier.stats()
        assert s.healthy and s.writes_enabled and s.reason == ""
        assert (s.write_probes, s.write_probe_failures, s.writes_disabled) == (3, 2, 1)
        assert faults.threads[0] == threading.current_thread().name
        assert all(t.startswith("kv-disk-probe-") for t in faults.threads[1:])  # never the caller's
        assert tier.write(2, payload(2, N)) and tier.read(2) == bytes(payload(2, N).numpy())
        assert [n for n in os.listdir(tmp_path / FP) if n.startswith(".tmp-")] == []
    finally:
        tier.close()


def test_an_error_streak_suspends_and_a_probe_resumes(tmp_path):
    faults = FaultInjector()
    tier = DiskTier(
        tmp_path, FP, 1 << 20, faults=faults, max_consecutive_write_errors=3, probe_interval_s=0.01
    )
    try:
        faults.fail("disk.write", errno.EIO, times=3)
        for h in (1, 2, 3):
            assert not tier.write(h, payload(h, N))
        assert "3 consecutive write errors" in tier.stats().reason
        wait_until(lambda: tier.stats().writes_reenabled == 1, timeout=120)
        assert tier.write(4, payload(4, N)) and tier.stats().writes_disabled == 1
    finally:
        tier.close()


def test_a_probe_backs_off_and_close_stops_it(tmp_path):
    faults = FaultInjector()
    tier = DiskTier(tmp_path, FP, 1 << 20, faults=faults, probe_interval_s=0.01, probe_max_interval_s=0.04)
    faults.fail("disk.write", errno.ENOSPC, times=1000)
    assert not tier.write(1, payload(1, N))
    wait_until(lambda: tier.stats().write_probe_failures >= 4, timeout=120)
    assert tier._probe_wait == 0.04  # doubled up to the cap
    prober = tier._prober
    tier.close()
    assert prober is not None and not prober.is_alive()
    assert not tier.stats().writes_enabled


def _read_only(path) -> bool:
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return True
    return shutil.which("chattr") is not None and not subprocess.run(["chattr", "+i", str(path)]).returncode


def _writable(path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path, 0o700)


def test_a_directory_made_writable_again_gets_writes_back(tmp_path):
    """A real read-only directory (chmod, or chattr as root): the write fails for real, the
    probe fails while it lasts and succeeds once it is fixed."""
    tier = DiskTier(tmp_path, FP, 1 << 20, probe_interval_s=0.01, probe_max_interval_s=0.05)
    fp_dir = tmp_path / FP
    if not _read_only(fp_dir):
        pytest.skip("cannot make a directory read-only here")
    try:
        assert not tier.write(1, payload(1, N))
        assert "not writable" in tier.stats().reason
        wait_until(lambda: tier.stats().write_probe_failures >= 1, timeout=120)
        assert not tier.stats().writes_enabled
    finally:
        _writable(fp_dir)
    try:
        wait_until(lambda: tier.stats().writes_reenabled == 1, timeout=120)
        assert tier.write(1, payload(1, N)) and tier.stats().healthy
    finally:
        tier.close()


def test_a_real_full_filesystem_recovers_when_space_is_freed(tmp_path):
    """A 256 KiB tmpfs fills for real, then an operator frees space (root only)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small filesystem")
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small filesystem here")
    try:
        filler = mnt / "filler"
        filler.write_bytes(bytes(200 << 10))
        tier = DiskTier(mnt, FP, 64 << 20, probe_interval_s=0.01, probe_max_interval_s=0.05)
        try:
            assert not tier.write(1, payload(1, 60 << 10))
            assert "disk full" in tier.stats().reason
            # a block does not fit yet
            wait_until(lambda: tier.stats().write_probe_failures >= 2, timeout=120)
            assert not tier.stats().writes_enabled
            filler.unlink()
            wait_until(lambda: tier.stats().writes_reenabled == 1, timeout=120)
            assert tier.write(1, payload(1, 60 << 10)) and tier.read(1) == bytes(payload(1, 60 << 10).numpy())
        finally:
            tier.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # -l: even if a test left it busy


# ---- old fingerprints ----


def _old_dir(root, hashes, mtime0=1000) -> None:
    old = DiskTier(root, OLD, 1 << 30)
    for i, h in enumerate(hashes):
        assert old.write(h, payload(h, N))
        os.utime(root / OLD / fmt.block_name(h), (mtime0 + i, mtime0 + i))
    old.close()


def _bytes_under(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.kvb"))


def test_old_fingerprints_count_in_the_budget_and_go_oldest_first(tmp_path):
    _old_dir(tmp_path, range(10, 14))  # four blocks of an older model
    tier = DiskTier(tmp_path, FP, 6 * PER)
    try:
        s = tier.stats()
        assert s.old_fingerprint_bytes == 4 * PER and s.old_fingerprint_dirs == 1 and s.used_bytes == 0
        for h in range(4):
            assert tier.write(h, payload(h, N))
        assert _bytes_under(tmp_path) <= 6 * PER  # the budget holds for the whole directory
        assert sorted(os.listdir(tmp_path / OLD)) == [fmt.block_name(12), fmt.block_name(13)]  # oldest went
        assert tier.stats().old_fingerprint_removed == 2 and tier.stats().evictions == 0
        for h in range(4, 6):
            assert tier.write(h, payload(h, N))
        assert not (tmp_path / OLD).exists()  # emptied, then removed
        s = tier.stats()
        assert s.old_fingerprint_bytes == 0 and s.old_fingerprint_dirs == 0 and s.num_blocks == 6
        assert all(tier.contains(h) for h in range(6))  # the running model lost nothing to them
    finally:
        tier.close()


def test_a_smaller_budget_at_start_removes_old_fingerprints_first(tmp_path):
    _old_dir(tmp_path, range(10, 14))
    (tmp_path / OLD / "notes.txt").write_text("not the tier's")
    tier = DiskTier(tmp_path, FP, PER)
    try:
        assert tier.stats().old_fingerprint_removed == 3 and _bytes_under(tmp_path) == PER
        assert sorted(os.listdir(tmp_path / OLD)) == [fmt.block_name(13), "notes.txt"]
        assert tier.write(1, payload(1, N))
        assert os.listdir(tmp_path / OLD) == ["notes.txt"]  # a directory holding other files stays
    finally:
        tier.close()


def test_an_upgrade_leaves_old_format_blocks_that_count_and_go_first(tmp_path):
    """Blocks of the previous format (64-bit names) are what an upgrade leaves behind in the
    old fingerprint's directory: counted in the budget and removed first, like any old file."""
    old = tmp_path / OLD
    old.mkdir()
    for i in range(3):
        (old / f"{i:016x}.kvb").write_bytes(b"\0" * PER)
        os.utime(old / f"{i:016x}.kvb", (1000 + i, 1000 + i))
    tier = DiskTier(tmp_path, FP, 3 * PER)
    try:
        assert tier.stats().old_fingerprint_bytes == 3 * PER
        assert tier.write(1, payload(1, N))
        assert sorted(os.listdir(old)) == [f"{i:016x}.kvb" for i in (1, 2)]  # the oldest went
    finally:
        tier.close()
