from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess

import pytest

from tierguard.kv.faults import FaultInjector
from tierguard.kv.guard import ColdContractViolation, decode_guard
from tierguard.kv.media.block_format import IDENTITY
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier

from .conftest import FP, payload

N = 4096


def block_path(root, h: int) -> str:
    return os.path.join(root, FP, fmt.block_name(h))


def test_roundtrip_file_mode_and_header(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    data = payload(5, N)
    assert tier.write(5, data)
    assert tier.read(5) == bytes(data.numpy())
    assert tier.read(6) is None
    st = os.stat(block_path(tmp_path, 5))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == fmt.HEADER_LEN + N
    assert stat.S_IMODE(os.stat(os.path.join(tmp_path, FP)).st_mode) == 0o700
    s = tier.stats()
    assert (s.hits, s.misses, s.writes, s.num_blocks) == (1, 1, 1, 1)


def test_restart_rebuilds_index_and_serves_saved_blocks(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    for h in range(10):
        assert tier.write(h, payload(h, N))
    tier.close()
    again = DiskTier(tmp_path, FP, 1 << 20)
    assert again.stats().num_blocks == 10 and again.stats().used_bytes == 10 * (N + fmt.HEADER_LEN)
    for h in range(10):
        assert again.read(h) == bytes(payload(h, N).numpy())


def test_other_fingerprint_never_sees_blocks(tmp_path):
    DiskTier(tmp_path, FP, 1 << 20).write(1, payload(1, N))
    other = DiskTier(tmp_path, "fedcba9876543210", 1 << 20)
    assert not other.contains(1) and other.read(1) is None


def test_budget_removes_least_recently_used_first(tmp_path):
    per_file = N + fmt.HEADER_LEN
    tier = DiskTier(tmp_path, FP, 3 * per_file)
    for h in (1, 2, 3):
        tier.write(h, payload(h, N))
    assert tier.read(1) is not None  # 2 is now the least recently used
    tier.write(4, payload(4, N))
    assert [tier.contains(h) for h in (1, 2, 3, 4)] == [True, False, True, True]
    assert not os.path.exists(block_path(tmp_path, 2))
    assert tier.stats().used_bytes <= 3 * per_file and tier.stats().evictions == 1


def test_lower_budget_on_restart_trims_oldest(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    for h in range(6):
        tier.write(h, payload(h, N))
        os.utime(block_path(tmp_path, h), (1000 + h, 1000 + h))
    tier.close()
    small = DiskTier(tmp_path, FP, 2 * (N + fmt.HEADER_LEN))
    assert [small.contains(h) for h in range(6)] == [False] * 4 + [True] * 2


def test_corrupted_payload_is_a_counted_miss_and_removed(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    tier.write(9, payload(9, N))
    with open(block_path(tmp_path, 9), "r+b") as f:
        f.seek(fmt.HEADER_LEN + 100)
        f.write(b"\xff\x00\xff")
    assert tier.read(9) is None
    s = tier.stats()
    assert s.corrupt == 1 and s.misses == 1 and not tier.contains(9)
    assert not os.path.exists(block_path(tmp_path, 9))
    assert tier.write(9, payload(9, N)) and tier.read(9) is not None  # recomputed and stored again


def test_torn_or_truncated_files_are_dropped_on_start(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    for h in (1, 2, 3):
        tier.write(h, payload(h, N))
    os.truncate(block_path(tmp_path, 1), fmt.HEADER_LEN + 10)
    with open(block_path(tmp_path, 2), "r+b") as f:
        f.write(b"XXXX")
    tier.close()
    again = DiskTier(tmp_path, FP, 1 << 20)
    assert [again.contains(h) for h in (1, 2, 3)] == [False, False, True]
    assert again.stats().cleaned_on_start == 2


def test_block_larger_than_budget_is_rejected_not_an_error(tmp_path):
    tier = DiskTier(tmp_path, FP, N // 2)
    assert not tier.write(1, payload(1, N))
    s = tier.stats()
    assert s.rejected_writes == 1 and s.healthy and s.write_errors == 0


def test_enospc_disables_writes_and_reports_health(tmp_path):
    faults = FaultInjector()
    tier = DiskTier(tmp_path, FP, 1 << 20, faults=faults, probe_interval_s=3600)  # no probe yet
    assert tier.write(1, payload(1, N))
    faults.fail("disk.write", errno.ENOSPC)
    assert not tier.write(2, payload(2, N))
    s = tier.stats()
    assert not s.healthy and not s.writes_enabled and "disk full" in s.reason
    assert not tier.write(3, payload(3, N))  # disabled, no attempt
    assert tier.stats().rejected_writes == 1
    assert tier.read(1) is not None and tier.read(2) is None  # reads go on; the failed block is a miss
    assert [n for n in os.listdir(os.path.join(tmp_path, FP)) if n.startswith(".tmp")] == []


def test_repeated_io_errors_disable_writes(tmp_path):
    faults = FaultInjector()
    tier = DiskTier(
        tmp_path, FP, 1 << 20, faults=faults, max_consecutive_write_errors=3, probe_interval_s=3600
    )
    faults.fail("disk.write", errno.EIO, times=2)
    assert not tier.write(1, payload(1, N)) and not tier.write(2, payload(2, N))
    assert tier.healthy  # two in a row: still trying
    assert tier.write(3, payload(3, N))  # success resets the run
    faults.fail("disk.write", errno.EIO, times=3)
    for h in (4, 5, 6):
        assert not tier.write(h, payload(h, N))
    assert not tier.healthy and "consecutive write errors" in tier.reason


def test_read_io_error_is_a_counted_miss(tmp_path):
    faults = FaultInjector()
    tier = DiskTier(tmp_path, FP, 1 << 20, faults=faults)
    tier.write(1, payload(1, N))
    faults.fail("disk.read", errno.EIO)
    assert tier.read(1) is None
    assert tier.stats().io_errors == 1


def _make_read_only(path) -> bool:
    if os.geteuid() != 0:
        os.chmod(path, 0o500)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def _undo_read_only(path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    os.chmod(path, 0o700)


def test_read_only_directory_is_unhealthy_but_serves_reads(tmp_path):
    DiskTier(tmp_path, FP, 1 << 20).write(1, payload(1, N))
    fp_dir = os.path.join(tmp_path, FP)
    if not _make_read_only(fp_dir):
        pytest.skip("cannot make a directory read-only here")
    try:
        tier = DiskTier(tmp_path, FP, 1 << 20)
        assert not tier.healthy and not tier.writes_enabled and "not writable" in tier.reason
        assert not tier.write(2, payload(2, N))
        assert tier.read(1) == bytes(payload(1, N).numpy())
    finally:
        _undo_read_only(fp_dir)


def test_unusable_root_is_unhealthy_not_a_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = DiskTier(blocker, FP, 1 << 20)  # root is a regular file
    assert not tier.healthy and tier.read(1) is None and not tier.write(1, payload(1, N))


def test_symlinked_fingerprint_dir_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / FP)
    tier = DiskTier(root, FP, 1 << 20)
    assert not tier.healthy and "symlink" in tier.reason
    assert not tier.write(1, payload(1, N))
    assert list(outside.iterdir()) == []


def test_symlinked_block_file_is_ignored(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 100)
    tier = DiskTier(tmp_path / "root", FP, 1 << 20)
    os.symlink(secret, tmp_path / "root" / FP / fmt.block_name(7))
    tier.close()
    again = DiskTier(tmp_path / "root", FP, 1 << 20)
    assert not again.contains(7) and secret.read_bytes() == b"s" * 100


def test_decode_guard_refuses_disk_reads(tmp_path):
    tier = DiskTier(tmp_path, FP, 1 << 20)
    tier.write(1, payload(1, N))
    with decode_guard():
        assert tier.contains(1)  # index lookups are not I/O and stay allowed
        with pytest.raises(ColdContractViolation):
            tier.read(1)
        with pytest.raises(ColdContractViolation):
            tier.read_into(1, bytearray(N))
    assert tier.stats().reads_in_decode == 2  # each refused read is counted before it raises
    assert tier.read(1) is not None  # outside the decode step it is fine
    assert tier.stats().hits == 1


def test_naive_spill_tier_allows_and_counts_reads_in_decode(tmp_path):
    from tierguard.baselines.naive_kv import NaiveSpillTier

    tier = NaiveSpillTier(tmp_path, FP, 1 << 20)  # benchmark only; the disk tier has no switch
    tier.write(1, payload(1, N))
    with decode_guard():
        assert tier.read(1) is not None
    assert tier.stats().reads_in_decode == 1


def test_real_full_filesystem_ends_in_misses_and_disabled_writes(tmp_path):
    """A 256 KiB tmpfs fills for real (root only; skipped elsewhere)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small filesystem")
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small filesystem here")
    try:
        tier = DiskTier(mnt, FP, 64 << 20, probe_interval_s=3600)  # the budget is larger than the filesystem
        results = [tier.write(h, payload(h, 60 << 10)) for h in range(1, 10)]
        assert results[0] and not all(results)
        s = tier.stats()
        assert not s.healthy and "disk full" in s.reason and s.write_errors == 1
        stored = [h for h in range(1, 10) if tier.contains(h)]
        assert stored == list(range(1, len(stored) + 1))
        for h in stored:
            assert tier.read(h) == bytes(payload(h, 60 << 10).numpy())
        assert not any(n.startswith(".tmp-") for n in os.listdir(mnt / FP))
        tier.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_concurrent_writers_keep_accounting_exact(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    tier = DiskTier(tmp_path, FP, 1 << 30)
    hashes = [h % 8 for h in range(64)]  # every block written by several threads at once
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(lambda h: tier.write(h, payload(h, N)), hashes))
    s = tier.stats()
    assert s.num_blocks == 8 and s.used_bytes == 8 * (N + fmt.HEADER_LEN)
    on_disk = sum(os.path.getsize(block_path(tmp_path, h)) for h in range(8))
    assert on_disk == s.used_bytes and sorted(os.listdir(tmp_path / FP)) == sorted(
        fmt.block_name(h) for h in range(8)
    )


class XorCodec:
    """A toy keyed codec (not encryption): xor with the key byte, then an 8-byte tag over
    the associated data and the payload. Enough to drive the codec path of the format."""

    codec_id = 7

    def __init__(self, key: int) -> None:
        self.key_id = key

    def stored_len(self, payload_len: int) -> int:
        return payload_len + 8

    def encode(self, payload, aad):
        import xxhash

        body = bytes(b ^ self.key_id for b in payload)
        return memoryview(body + xxhash.xxh3_64_digest(aad + bytes(payload)))

    def decode(self, stored, aad, out, key_id) -> bool:
        import xxhash

        if key_id != self.key_id:
            return False
        plain = bytes(b ^ self.key_id for b in stored[:-8])
        if xxhash.xxh3_64_digest(aad + plain) != bytes(stored[-8:]):
            return False
        out[:] = plain
        return True


def test_a_codec_wraps_the_stored_bytes_and_an_undecodable_block_is_a_kept_miss(tmp_path):
    data = payload(3, N)
    assert DiskTier(tmp_path, FP, 1 << 20, codec=XorCodec(0x5A)).write(3, data)
    raw = open(block_path(tmp_path, 3), "rb").read()
    assert len(raw) == fmt.HEADER_LEN + N + 8 and bytes(data.numpy()) not in raw
    assert DiskTier(tmp_path, FP, 1 << 20, codec=XorCodec(0x5A)).read(3) == bytes(data.numpy())
    for codec in (IDENTITY, XorCodec(0x11)):
        reader = DiskTier(tmp_path, FP, 1 << 20, codec=codec)
        assert reader.read(3) is None  # another codec or key: a miss, never an error
        s = reader.stats()
        assert s.undecodable == 1 and s.corrupt == 0
        assert os.path.exists(block_path(tmp_path, 3))  # kept for a reader with the right key
        reader.close()  # one tier per directory at a time
