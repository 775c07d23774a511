"""What names a KV block, and what the cold tiers check before they serve one:

- block hashes are a SHA-256 chain over the token ids, rooted in the model's fingerprint
  and the request's cache salt (no 64-bit name two prompts can be made to share);
- the block format (version 3) keeps the whole 256-bit hash in the header; the disk and
  Redis tiers serve a block only when it equals the reader's: a block made from other
  tokens under the reader's name is a counted `verify_mismatch`, removed, never served;
  a block of the previous format is a counted miss, never a traceback;
- the weights digest behind the fingerprint follows the file's content, from a cache
  keyed by the file's identity (an in-place rewrite with its mtime set back is hashed again).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time

import numpy as np
import pytest
import redis

from tests.kv.conftest import FP, payload
from tierguard.engine.prefix_hash import block_hash, prefix_block_hashes, root_hash
from tierguard.kv import weights_digest
from tierguard.kv.groups import group_key
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier
from tierguard.kv.media.remote.tier import RemoteTier
from tierguard.kv.spec import fingerprint_salt
from tierguard.kv.weights_digest import file_digest

N = 256  # payload bytes of a test block
ROOT = fingerprint_salt(FP)
A = list(range(100, 132))  # two blocks of 16 tokens
B = list(range(200, 232))


def sha_chain(tokens: list[int], root: int, bs: int = 16) -> list[int]:
    out, prev = [], root
    for i in range(len(tokens) // bs):
        data = prev.to_bytes(32, "little") + np.asarray(tokens[i * bs : (i + 1) * bs], dtype=np.int64).tobytes()
        prev = int.from_bytes(hashlib.sha256(data).digest(), "little")
        out.append(prev)
    return out


def test_block_hashes_are_a_sha256_chain_rooted_in_the_fingerprint_and_the_salt():
    hashes = prefix_block_hashes(A, 16, ROOT)
    assert hashes == sha_chain(A, ROOT) and all(h >= 2**64 for h in hashes)  # not a 64-bit name
    assert block_hash(hashes[0], A[16:32]) == hashes[1]
    assert prefix_block_hashes(A, 16, ROOT, start=1, parent=hashes[0]) == hashes[1:]
    salted = prefix_block_hashes(A, 16, root_hash(ROOT, "tenant-a"))
    assert root_hash(ROOT, None) == root_hash(ROOT, "") == ROOT
    assert not set(salted) & set(hashes)  # another salt: no block in common
    assert not set(salted) & set(prefix_block_hashes(A, 16, root_hash(ROOT, "tenant-b")))
    assert group_key(hashes[0], 0) == hashes[0] and group_key(hashes[0], 1) != group_key(hashes[0], 2)


def test_block_header_holds_the_whole_hash_and_refuses_the_previous_format():
    h = prefix_block_hashes(A, 16, ROOT)[1]
    stored = memoryview(bytes(range(64)))
    head = blk.encode_header(blk.header_for(FP, h, stored))
    assert len(head) == blk.HEADER_LEN == 128 and blk.decode_header(head).block_hash == h
    assert blk.verify(blk.decode_header(head), FP, h, stored)
    assert not blk.identity_matches(blk.decode_header(head), FP, h ^ (1 << 200))  # same low bits, other block
    old = struct.pack("<4sHH16sQQQHHI", b"TGKV", 2, 64, FP.encode(), h & blk.U64_MAX, 64, 0, 0, 0, 0)
    with pytest.raises(blk.BadHeader, match="unsupported version 2"):
        blk.decode_header(old + bytes(8))


def _forge(tier_dir, victim: int, other: int) -> None:
    """Put the block made for `other` (header and all) under `victim`'s name."""
    d = tier_dir / FP
    os.replace(d / fmt.block_name(other), d / fmt.block_name(victim))


def test_disk_a_block_from_other_tokens_under_the_readers_name_is_a_counted_miss(tmp_path):
    a1, a2 = prefix_block_hashes(A, 16, ROOT)
    b1 = prefix_block_hashes(B, 16, ROOT)[0]
    twin = a1 ^ (1 << 255)  # the same low 64 bits: a 64-bit name would be a1's
    tier = DiskTier(tmp_path, FP, 1 << 20)
    assert tier.write_many([(a1, payload(a1, N)), (a2, payload(a2, N)), (b1, payload(b1, N))]) == [True] * 3
    assert not tier.contains(twin) and fmt.block_name(twin) != fmt.block_name(a1)
    _forge(tmp_path, a1, b1)  # a writer with access to the directory swaps the file
    out = bytearray(N)
    assert tier.read_many([(a1, out), (a2, bytearray(N))]) == [False, True]
    s = tier.stats()
    assert (s.verify_mismatch, s.corrupt, s.misses, s.hits) == (1, 0, 1, 1)
    assert not (tmp_path / FP / fmt.block_name(a1)).exists() and not tier.contains(a1)  # removed
    # A block of the previous format under a valid name: a counted miss, no traceback.
    old = struct.pack("<4sHH16sQQQHHI", b"TGKV", 2, 64, FP.encode(), a2 & blk.U64_MAX, N, 0, 0, 0, 0)
    (tmp_path / FP / fmt.block_name(a2)).write_bytes(old + bytes(8) + bytes(N))
    assert tier.read_many([(a2, bytearray(N))]) == [False] and tier.stats().corrupt == 1
    tier.close()


def test_redis_a_block_from_other_tokens_under_the_readers_key_is_a_counted_miss(redis_server):
    a1 = prefix_block_hashes(A, 16, ROOT)[0]
    b1 = prefix_block_hashes(B, 16, ROOT)[0]
    tier = RemoteTier(redis_server.url, FP, N, 1 << 20, refresh_s=0.05, timeout_ms=500)
    try:
        assert tier.write_many([(a1, payload(a1, N)), (b1, payload(b1, N))]) == [True, True]
        r = redis.Redis.from_url(redis_server.url)
        r.set(tier.key(a1), r.get(tier.key(b1)))  # anyone who can write to Redis
        assert tier.read_many([(a1, bytearray(N)), (b1, bytearray(N))]) == [False, True]
        s = tier.stats()
        assert (s.verify_mismatch, s.corrupt, s.misses) == (1, 0, 1)
        assert r.get(tier.key(a1)) is None and not tier.contains(a1)  # deleted, dropped from the index
        old = struct.pack("<4sHH16sQQQHHI", b"TGKV", 2, 64, FP.encode(), b1 & blk.U64_MAX, N, 0, 0, 0, 0)
        r.set(tier.key(b1), old + bytes(8) + bytes(N))  # the previous format
        assert tier.read_many([(b1, bytearray(N))]) == [False] and tier.stats().corrupt == 1
    finally:
        tier.close()


def test_weights_digest_follows_content_not_size_or_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(weights_digest, "RACY_S", 0.05)
    cache = tmp_path / "cache"
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x01" * 4096)
    st = os.stat(f)
    assert file_digest(f, cache) and not cache.exists()  # changed just now: not cached yet
    time.sleep(0.1)
    first = file_digest(f, cache)
    assert first == hashlib.sha256(b"\x01" * 4096).hexdigest()
    # The cache answers while the file is unchanged: a planted record is believed...
    (record,) = cache.iterdir()
    record.write_text(record.read_text().replace(first, "ab" * 32))
    assert file_digest(f, cache) == "ab" * 32
    time.sleep(0.1)  # past the timestamps' granularity
    # ...but an in-place rewrite of the same size, its mtime set back, is hashed again.
    with open(f, "r+b") as fh:
        fh.write(b"\x02")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    assert file_digest(f, cache) == hashlib.sha256(b"\x02" + b"\x01" * 4095).hexdigest()
