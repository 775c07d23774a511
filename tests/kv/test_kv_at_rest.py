"""Cold KV at rest: AES-256-GCM blocks on the disk tier, key rotation, wrong keys as misses,
the TTL sweeper and `tierguard kv purge`. Real files, real keys, real AES (cryptography)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from tierguard.cli.main import main
from tierguard.common.errors import TierguardError
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.aead_codec import AesGcmCodec, header_key_id
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier

FP = "a1b2c3d4e5f60718"
N = 4096


def key_file(path) -> str:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    d.mkdir(mode=0o700)
    return {name: key_file(d / name) for name in ("A", "B")}


def kv_like(seed: int, n: int = N) -> torch.Tensor:
    """Bytes shaped like a KV block: float16 values of smooth curves, so runs repeat (a
    harder case for a 'no plaintext run' check than random bytes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(0, 6.28, n // 2).unsqueeze(0) * torch.rand(1, generator=g)
    return torch.sin(x).round(decimals=2).to(torch.float16).view(torch.uint8).reshape(-1).contiguous()


def shares_a_run(plain: bytes, blob: bytes, n: int = 64) -> bool:
    """True if any n consecutive bytes of `plain` appear in `blob`."""
    runs = {plain[i : i + n] for i in range(len(plain) - n + 1)}
    return any(blob[i : i + n] in runs for i in range(len(blob) - n + 1))


def path_of(root, h: int):
    return root / FP / fmt.block_name(h)


def tier(root, codec=blk.IDENTITY, **kw) -> DiskTier:
    return DiskTier(root, FP, 1 << 20, codec=codec, **kw)


def test_blocks_are_sealed_no_plaintext_run_reaches_the_file(tmp_path, keys):
    codec = AesGcmCodec.from_files(keys["A"])
    data = [kv_like(i) for i in range(4)]
    enc, plain = tier(tmp_path / "enc", codec), tier(tmp_path / "plain")
    for h, d in enumerate(data):
        assert enc.write(h, d) and plain.write(h, d)
    for h, d in enumerate(data):
        raw = path_of(tmp_path / "enc", h).read_bytes()
        # the claim first: no 64-byte run of the plaintext is in the file (a check that can
        # fail: the unencrypted tier's file has them); the envelope's shape after it
        assert not shares_a_run(bytes(d.numpy()), raw)
        assert shares_a_run(bytes(d.numpy()), path_of(tmp_path / "plain", h).read_bytes())
        header = blk.decode_header(raw)
        assert (header.codec, header.key_id) == (1, header_key_id(codec.ring.current))
        assert len(raw) == fmt.HEADER_LEN + N + 40  # envelope: magic, key id, nonce, tag
        assert enc.read(h) == bytes(d.numpy())
    assert os.stat(path_of(tmp_path / "enc", 0)).st_mode & 0o777 == 0o600


def test_wrong_or_missing_key_is_a_counted_miss_that_never_overwrites(tmp_path, keys):
    a, b = AesGcmCodec.from_files(keys["A"]), AesGcmCodec.from_files(keys["B"])
    data = kv_like(7)
    assert tier(tmp_path, a).write(3, data)
    before = path_of(tmp_path, 3).read_bytes()
    for codec in (b, blk.IDENTITY):  # another key; no key at all
        reader = tier(tmp_path, codec)
        assert reader.contains(3)
        assert reader.read(3) is None  # a miss, never an exception
        s = reader.stats()
        assert s.undecodable == 1 and s.corrupt == 0 and s.undecodable_blocks == 1
        assert not reader.contains(3)  # not offered again
        assert not reader.write(3, data)  # and never overwritten: the right key's block survives
        assert reader.stats().rejected_writes == 1
        reader.close()
    assert path_of(tmp_path, 3).read_bytes() == before
    assert tier(tmp_path, a).read(3) == bytes(data.numpy())  # key A again: a hit


def test_a_block_moved_under_another_name_fails_authentication(tmp_path, keys):
    codec = AesGcmCodec.from_files(keys["A"])
    assert tier(tmp_path, codec).write(1, kv_like(1))
    raw = path_of(tmp_path, 1).read_bytes()
    h = blk.decode_header(raw)
    moved = blk.Header(h.fingerprint, 2, h.payload_len, h.payload_xxh3, h.codec, h.key_id)
    path_of(tmp_path, 2).write_bytes(blk.encode_header(moved) + raw[fmt.HEADER_LEN :])  # a valid header
    reader = tier(tmp_path, codec)
    assert reader.read(1) is not None and reader.read(2) is None  # the hash is associated data
    assert reader.stats().undecodable == 1


def test_rotation_reads_old_blocks_and_reseals_them_with_the_new_key(tmp_path, keys):
    old, new = AesGcmCodec.from_files(keys["A"]), AesGcmCodec.from_files(keys["B"], [keys["A"]])
    data = {h: kv_like(h) for h in range(5)}
    t = tier(tmp_path, old)
    for h, d in data.items():
        assert t.write(h, d)
    t.close()
    past = time.time() - 3600
    os.utime(path_of(tmp_path, 0), (past, past))
    rotating = tier(tmp_path, new)
    assert rotating.stats().old_key_blocks == 5
    assert rotating.read(4) == bytes(data[4].numpy())  # old blocks stay readable meanwhile
    assert rotating.write(9, kv_like(9))  # new blocks get the new key
    assert blk.decode_header(path_of(tmp_path, 9).read_bytes()).key_id == new.key_id
    assert rotating.reseal(limit=2) == 2 and rotating.reseal() == 3 and rotating.reseal() == 0
    s = rotating.stats()
    assert s.resealed == 5 and s.old_key_blocks == 0 and s.num_blocks == 6
    assert os.stat(path_of(tmp_path, 0)).st_mtime == pytest.approx(past, abs=1)  # a reseal is not a use
    rotating.close()
    only_new = tier(tmp_path, AesGcmCodec.from_files(keys["B"]))  # the old key can go now
    assert all(only_new.read(h) == bytes(d.numpy()) for h, d in data.items())
    assert only_new.stats().undecodable == 0


def test_the_sweeper_reseals_in_the_background(tmp_path, keys):
    t = tier(tmp_path, AesGcmCodec.from_files(keys["A"]))
    assert t.write(1, kv_like(1))
    t.close()
    rotating = tier(tmp_path, AesGcmCodec.from_files(keys["B"], [keys["A"]]), sweep_interval_s=0.02)
    deadline = time.monotonic() + 10
    while rotating.stats().resealed < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rotating.stats().resealed == 1
    sweeper = next(t for t in threading.enumerate() if t.name == f"kv-disk-sweeper-{FP}")
    rotating.close()
    assert not sweeper.is_alive()


def test_plaintext_blocks_are_removed_when_encryption_is_on(tmp_path, keys):
    plain = tier(tmp_path)
    assert plain.write(1, kv_like(1)) and plain.write(2, kv_like(2))
    plain.close()
    enc = tier(tmp_path, AesGcmCodec.from_files(keys["A"]))
    s = enc.stats()
    assert s.plaintext_removed == 2 and s.num_blocks == 0 and s.used_bytes == 0
    assert not path_of(tmp_path, 1).exists() and not path_of(tmp_path, 2).exists()


def test_key_files_are_checked(tmp_path, keys):
    loose = tmp_path / "loose"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o644)
    with pytest.raises(TierguardError, match="group or others"):
        AesGcmCodec.from_files(str(loose))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 10)
    short.chmod(0o600)
    with pytest.raises(TierguardError, match="32 bytes"):
        AesGcmCodec.from_files(keys["A"], [str(short)])
    assert "secret" not in repr(AesGcmCodec.from_files(keys["A"]))


def test_ttl_removes_blocks_not_used_for_that_long(tmp_path):
    t = tier(tmp_path)
    for h in range(3):
        assert t.write(h, kv_like(h))
    t.close()
    now = time.time()
    for h, age in ((0, 500), (1, 50), (2, 500)):
        os.utime(path_of(tmp_path, h), (now - age, now - age))
    t = tier(tmp_path, ttl_s=100, sweep_interval_s=3600)  # the sweep is driven by hand here
    assert t.read(2) is not None  # a read hit is a use: block 2 is young again
    assert os.stat(path_of(tmp_path, 2)).st_mtime > now - 5  # and that survives a restart
    assert t.expire() == 1
    assert not path_of(tmp_path, 0).exists() and path_of(tmp_path, 1).exists()
    assert t.expire(now=now + 60) == 1  # block 1 is 110 s old then
    s = t.stats()
    assert s.expired == 2 and s.num_blocks == 1 and s.used_bytes == os.path.getsize(path_of(tmp_path, 2))
    assert not t.contains(0) and t.read(0) is None
    t.close()


def test_the_ttl_sweeper_runs_on_its_own_thread(tmp_path):
    t = tier(tmp_path, ttl_s=0.2, sweep_interval_s=0.05)
    assert t.write(1, kv_like(1))
    deadline = time.monotonic() + 10
    while t.stats().num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.stats().expired == 1 and not path_of(tmp_path, 1).exists()
    t.close()


def _purge(capsys, *argv) -> tuple[int, list[str], list[str]]:
    code = main(["kv", "purge", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_purge_removes_only_what_the_tier_wrote(tmp_path, capsys):
    t = tier(tmp_path)
    for h in range(4):
        assert t.write(h, kv_like(h))
    t.close()
    other_fp = DiskTier(tmp_path, "ffffffffffffffff", 1 << 20)
    assert other_fp.write(1, kv_like(1))
    other_fp.close()
    now = time.time()
    for h in (0, 1):
        os.utime(path_of(tmp_path, h), (now - 7200, now - 7200))
    fp_dir = tmp_path / FP
    (fp_dir / "notes.txt").write_text("mine")
    (fp_dir / "0000000000000009.kvb").write_bytes(b"not a block")
    os.symlink(path_of(tmp_path, 3), fp_dir / "00000000000000aa.kvb")
    (tmp_path / "unrelated").mkdir()
    before = sorted(os.listdir(fp_dir))

    code, out, err = _purge(capsys, str(tmp_path), "--older-than", "1h", "--fingerprint", FP, "--dry-run")
    assert code == 0 and not err and len(out) == 1
    assert out[0].startswith("would remove 2 block files") and "kept 2" in out[0] and "3 other" in out[0]
    assert sorted(os.listdir(fp_dir)) == before

    code, out, _ = _purge(capsys, str(tmp_path), "--older-than", "1h", "--fingerprint", FP)
    assert code == 0 and out[0].startswith("removed 2 block files")
    assert sorted(os.listdir(fp_dir)) == sorted(set(before) - {fmt.block_name(0), fmt.block_name(1)})

    code, out, _ = _purge(capsys, str(tmp_path))  # every fingerprint, every block
    assert code == 0 and len(out) == 2
    assert sorted(os.listdir(fp_dir)) == ["0000000000000009.kvb", "00000000000000aa.kvb", "notes.txt"]
    assert os.listdir(tmp_path / "ffffffffffffffff") == [] and (tmp_path / "unrelated").is_dir()
    assert DiskTier(tmp_path, FP, 1 << 20).stats().num_blocks == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{root}/absent"], "cannot read"),
        (["{root}", "--older-than", "soon"], "--older-than"),
        (["{root}", "--older-than", "0s"], "longer than zero"),
        (["{root}", "--fingerprint", "ABC"], "16 lowercase hex"),
        (["{root}", "--fingerprint", "0000000000000000"], "no KV tier directory"),
        (["{root}/file"], "not a directory"),
    ],
)
def test_purge_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("x")
    code, out, err = _purge(capsys, *[a.format(root=tmp_path) for a in argv])
    assert code == 2 and not out and len(err) == 1 and message in err[0], err


def test_purge_of_an_empty_directory_says_so(tmp_path, capsys):
    code, out, _ = _purge(capsys, str(tmp_path))
    assert code == 0 and out == [f"nothing to purge: {tmp_path} holds no KV tier directories"]
