"""Cold KV at rest, on the path the tiers use: `AesGcmCodec.encode` (KeyRing.seal_into), not
only `KeyRing.seal`. Every sealed block gets a fresh nonce, and the associated data binds
the block to its model fingerprint as well as to its hash: the same bytes opened under
another model fail authentication (the codec's own check, before any header or index
check of the medium could refuse them). Real keys, real AES-GCM (cryptography)."""

from __future__ import annotations

import os

import pytest
import torch

from tierguard.common.crypto import HEADER_BYTES, KEY_ID_BYTES, MAGIC, DecryptError, Key, KeyRing
from tierguard.kv.media import block_format as blk
from tierguard.kv.media.aead_codec import AesGcmCodec
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier

FP, OTHER_FP = "a1b2c3d4e5f60718", "0f1e2d3c4b5a6978"
N = 4096
NONCE_AT = len(MAGIC) + KEY_ID_BYTES


def codec() -> AesGcmCodec:
    return AesGcmCodec(KeyRing(Key(os.urandom(32))))


def payload(seed: int = 0) -> memoryview:
    g = torch.Generator().manual_seed(seed)
    return memoryview(bytearray(torch.randint(0, 256, (N,), generator=g, dtype=torch.uint8).numpy().tobytes()))


def nonce(stored: bytes | memoryview) -> bytes:
    return bytes(stored[NONCE_AT:HEADER_BYTES])


def test_every_block_the_codec_seals_gets_a_fresh_nonce():
    c = codec()
    data = payload(1)
    aad = blk.associated_data(FP, 7)
    sealed = [bytes(c.encode(data, aad)) for _ in range(64)]  # the same block, sealed again and again
    assert len({nonce(s) for s in sealed}) == 64
    assert len({s[HEADER_BYTES:] for s in sealed}) == 64  # so no two ciphertexts (or keystreams) repeat
    out = memoryview(bytearray(N))
    assert c.decode(memoryview(sealed[-1]), aad, out, c.key_id) and bytes(out) == bytes(data)


def test_blocks_written_by_the_disk_tier_carry_distinct_nonces(tmp_path):
    c = codec()
    t = DiskTier(tmp_path, FP, 1 << 20, codec=c)
    same = torch.frombuffer(bytearray(payload(2)), dtype=torch.uint8)
    for h in range(8):  # the same payload under eight hashes: eight writes through seal_into
        assert t.write(h, same)
    t.close()
    stored = [(tmp_path / FP / fmt.block_name(h)).read_bytes()[fmt.HEADER_LEN :] for h in range(8)]
    assert len({nonce(s) for s in stored}) == 8


def test_the_same_hash_under_another_fingerprint_fails_authentication():
    c = codec()
    data = payload(3)
    stored = c.encode(data, blk.associated_data(FP, 42))
    out = memoryview(bytearray(N))
    # another model, the same block hash: the codec refuses and leaves no plaintext behind
    assert not c.decode(stored, blk.associated_data(OTHER_FP, 42), out, c.key_id)
    assert bytes(out) == bytes(N)
    # and the reason is GCM's tag, not a length or key check
    with pytest.raises(DecryptError, match="authentication failed"):
        c.ring.open_into(stored, blk.associated_data(OTHER_FP, 42), out)
    assert c.decode(stored, blk.associated_data(FP, 42), out, c.key_id) and bytes(out) == bytes(data)


def test_associated_data_differs_for_each_model_and_each_block():
    aads = {blk.associated_data(fp, h) for fp in (FP, OTHER_FP) for h in (0, 1, 2**64 - 1)}
    assert len(aads) == 6
