"""The AES-256-GCM envelope (tierguard/common/crypto.py): what it opens and what it refuses."""

from __future__ import annotations

import base64
import os

import pytest

from tierguard.common.crypto import OVERHEAD_BYTES, DecryptError, Key, KeyRing, is_sealed, sealed_key_id
from tierguard.common.errors import TierguardError


def _key_file(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_seal_open_round_trip_and_no_plaintext_on_the_wire():
    ring = KeyRing(Key(os.urandom(32)))
    secret = b"the patient's name is " + b"A" * 200
    blob = ring.seal(secret, b"job-1")
    assert is_sealed(blob) and len(blob) == len(secret) + OVERHEAD_BYTES
    assert b"patient" not in blob and b"A" * 16 not in blob
    assert ring.open(blob, b"job-1") == secret
    assert ring.seal(secret, b"job-1") != blob  # a fresh nonce per seal


@pytest.mark.parametrize("damage", ["aad", "flip", "truncate", "plain", "other_key"])
def test_every_failure_is_one_clean_decrypt_error(damage):
    ring = KeyRing(Key(os.urandom(32)))
    blob = ring.seal(b"payload", b"job-1")
    aad = b"job-1"
    if damage == "aad":  # the same bytes stored under another name
        aad = b"job-2"
    elif damage == "flip":
        blob = blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:]
    elif damage == "truncate":
        blob = blob[:30]
    elif damage == "plain":
        blob = b'{"prompt": "x"}'
    elif damage == "other_key":
        blob = KeyRing(Key(os.urandom(32))).seal(b"payload", b"job-1")
    with pytest.raises(DecryptError) as info:
        ring.open(blob, aad)
    assert str(info.value).startswith("cannot decrypt: ")
    if damage == "other_key":
        assert sealed_key_id(blob).hex() in str(info.value)  # names the key it would need


def test_rotation_reads_old_blobs_and_writes_with_the_new_key():
    old, new = Key(os.urandom(32)), Key(os.urandom(32))
    blob_old = KeyRing(old).seal(b"written before the rotation", b"a")
    ring = KeyRing(new, [old])
    assert ring.open(blob_old, b"a") == b"written before the rotation"
    assert ring.needs_reseal(blob_old)
    fresh = ring.seal(b"after", b"a")
    assert sealed_key_id(fresh) == new.id and not ring.needs_reseal(fresh)
    with pytest.raises(DecryptError):
        KeyRing(old).open(fresh, b"a")  # the old key alone cannot read new blobs


def test_key_files_raw_hex_base64_and_refusals(tmp_path):
    secret = os.urandom(32)
    ids = {Key.from_file(_key_file(tmp_path / name, data)).id for name, data in
           (("raw", secret), ("hex", secret.hex().encode() + b"\n"), ("b64", base64.b64encode(secret) + b"\n"))}
    assert ids == {Key(secret).id}
    with pytest.raises(TierguardError, match="chmod 600"):
        Key.from_file(_key_file(tmp_path / "loose", secret, 0o644))
    with pytest.raises(TierguardError, match="must hold 32 bytes"):
        Key.from_file(_key_file(tmp_path / "short", b"0123abcd\n"))
    with pytest.raises(TierguardError, match="cannot read key file"):
        Key.from_file(tmp_path / "missing")
    assert "secret" not in repr(Key(secret)) and secret.hex() not in repr(Key(secret))
