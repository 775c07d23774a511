"""Who owns a disk tier directory: a lock, not a pid. Names out of range are not ours.

Real subprocesses hold a tier and stop in the middle of a write (a temporary file in
flight); a second tier, `tierguard kv purge` and a restart after a kill -9 each do what
the lock says, including for a writer in another PID namespace (root only).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.owner import LOCK_NAME, DirInUse, parse_pid
from tierguard.kv.media.disk.purge import purge_dir
from tierguard.kv.media.disk.tier import DiskTier

from .conftest import FP, payload
from .pidns import pid_namespace_argv

ROOT = Path(__file__).resolve().parents[2]
N = 4096
ODD_TEMP = f".tmp-{7:016x}-99999999999999999999-0"


def test_parse_pid_has_bounds():
    assert parse_pid("1") == 1 and parse_pid("4194304") == 4194304
    for bad in ("0", "4194305", "99999999999999999999", "", "-1", "12a", "١٢"):
        assert parse_pid(bad) is None


def test_an_overflowing_temporary_name_starts_purges_and_is_left_alone(tmp_path):
    DiskTier(tmp_path, FP, 1 << 20).close()
    odd = tmp_path / FP / ODD_TEMP
    odd.write_bytes(b"x")
    tier = DiskTier(tmp_path, FP, 1 << 20)  # the scan does not parse it as a pid
    assert tier.write(1, payload(1, N))
    tier.close()
    report = purge_dir(str(tmp_path), FP, None, dry_run=False)
    assert report.removed == 1 and report.left_alone == 1 and odd.exists()
    cli = subprocess.run(
        [sys.executable, "-m", "tierguard", "kv", "purge", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert cli.returncode == 0 and "Traceback" not in cli.stderr and "left 1 other entry alone" in cli.stdout


WRITER = textwrap.dedent(
    """
    import sys, torch
    from tierguard.kv.media.disk.tier import DiskTier

    tier = DiskTier(sys.argv[1], "0123456789abcdef", 1 << 30)
    tier.write(1, torch.ones(4096, dtype=torch.uint8))
    real = DiskTier._write_all

    def half_then_wait(fd, mv):
        if mv.nbytes == 4096:  # block 2's payload: write half, then hold the file in flight
            real(fd, mv[:2048])
            print("MID", flush=True)
            sys.stdin.read()
            mv = mv[2048:]
        real(fd, mv)

    DiskTier._write_all = staticmethod(half_then_wait)
    print("WROTE" if tier.write(2, torch.ones(4096, dtype=torch.uint8)) else "LOST", flush=True)
    """
)


def _writer(root: Path, prefix: list[str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen(
        [*(prefix or []), sys.executable, "-c", WRITER, str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert p.stdout.readline().strip() == "MID"
    return p


def _temps(root: Path) -> list[str]:
    return [n for n in os.listdir(root / FP) if n.startswith(".tmp-")]


def _check_live_writer_is_untouched(root: Path, writer: subprocess.Popen) -> None:
    (in_flight,) = _temps(root)
    with pytest.raises(DirInUse) as e:
        DiskTier(root, FP, 1 << 30, lock_wait_s=0)  # a second server on the directory
    assert "in use by pid" in str(e.value) and "--kv-disk-dir" in str(e.value)
    report = purge_dir(str(root), FP, None, dry_run=False)
    assert report.in_flight == 1 and report.leftovers == 0
    assert _temps(root) == [in_flight]  # neither touched the file in flight
    writer.stdin.close()  # let the write finish
    assert writer.stdout.readline().strip() == "WROTE"
    writer.wait()
    again = DiskTier(root, FP, 1 << 30, lock_wait_s=0)  # its owner is gone: the lock is free
    assert again.contains(2) and again.stats().cleaned_on_start == 0
    again.close()


def test_a_live_writers_directory_and_file_in_flight_are_never_touched(tmp_path):
    writer = _writer(tmp_path)
    try:
        _check_live_writer_is_untouched(tmp_path, writer)
    finally:
        writer.kill()


def test_a_live_writer_in_another_pid_namespace_is_never_touched(tmp_path):
    """Its pid, as its temporary file names it, is none of ours: a pid check would call
    it dead and delete the file mid-write."""
    ns = pid_namespace_argv()
    if ns is None:
        pytest.skip("needs root and unshare to make a PID namespace")
    prefix, pid_inside = ns
    writer = _writer(tmp_path, prefix)
    try:
        (temp,) = _temps(tmp_path)
        assert temp.split("-")[2] == str(pid_inside)
        _check_live_writer_is_untouched(tmp_path, writer)
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait()


def test_after_a_kill_9_the_next_start_and_purge_remove_the_leftover(tmp_path):
    writer = _writer(tmp_path)
    writer.kill()
    writer.wait()
    assert len(_temps(tmp_path)) == 1
    report = purge_dir(str(tmp_path), FP, None, dry_run=True)
    assert report.leftovers == 1 and report.in_flight == 0  # nobody holds the lock
    tier = DiskTier(tmp_path, FP, 1 << 30, lock_wait_s=0)
    assert tier.stats().cleaned_on_start == 1 and _temps(tmp_path) == []
    assert tier.contains(1) and not tier.contains(2)
    tier.close()


def test_the_lock_is_released_on_close_and_when_a_tier_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    with pytest.raises(DirInUse):
        DiskTier(tmp_path, "fedcba9876543210", 1 << 20, lock_wait_s=0)  # any fingerprint
    tier.close()
    DiskTier(tmp_path, FP, 1 << 20, lock_wait_s=0)  # dropped at once, never closed
    DiskTier(tmp_path, FP, 1 << 20, lock_wait_s=0).close()
    assert (tmp_path / LOCK_NAME).exists()


def test_a_server_waits_for_a_predecessor_still_closing(tmp_path):
    import threading

    first = DiskTier(tmp_path, FP, 1 << 20)
    threading.Timer(0.2, first.close).start()
    second = DiskTier(tmp_path, FP, 1 << 20, lock_wait_s=60)
    assert second.healthy
    second.close()


def test_a_live_servers_temporary_files_are_found_by_lock_not_name(tmp_path):
    """A temporary-looking file of this process's own pid, while no tier holds the lock:
    a leftover (purge removes it); while one does: in flight (left alone)."""
    DiskTier(tmp_path, FP, 1 << 20).close()
    name = fmt.temp_name(5, os.getpid(), 0)
    (tmp_path / FP / name).write_bytes(b"partial")
    tier = DiskTier(tmp_path, "fedcba9876543210", 1 << 20)  # holds the directory
    try:
        assert purge_dir(str(tmp_path), FP, None, dry_run=False).in_flight == 1
        assert (tmp_path / FP / name).exists()
    finally:
        tier.close()
    assert purge_dir(str(tmp_path), FP, None, dry_run=False).leftovers == 1
    assert not (tmp_path / FP / name).exists()


def _read_only(path) -> bool:
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return True
    import shutil

    return shutil.which("chattr") is not None and not subprocess.run(["chattr", "+i", str(path)]).returncode


def _writable(path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path, 0o700)


def test_a_read_only_volume_of_saved_blocks_still_serves_reads(tmp_path):
    """No lock can be made where nothing can be written: the tier reads, removes nothing."""
    tier = DiskTier(tmp_path, FP, 1 << 20)
    assert tier.write(1, payload(1, N))
    tier.close()
    (tmp_path / LOCK_NAME).unlink()
    leftover = tmp_path / FP / fmt.temp_name(2, 12345, 0)
    leftover.write_bytes(b"x")
    if not (_read_only(tmp_path / FP) and _read_only(tmp_path)):
        _writable(tmp_path / FP)
        pytest.skip("cannot make a directory read-only here")
    try:
        ro = DiskTier(tmp_path, FP, 1 << 20, lock_wait_s=0)
        assert ro.read(1) == bytes(payload(1, N).numpy())
        assert not ro.healthy and "reads only" in ro.reason and not ro.write(3, payload(3, N))
        assert leftover.exists()  # not its to remove without the lock
        ro.close()
    finally:
        _writable(tmp_path)
        _writable(tmp_path / FP)
