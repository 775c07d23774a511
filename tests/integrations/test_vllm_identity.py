"""What names the vLLM connector's blocks (layout.py), without vLLM: the fingerprint holds
the content of the checkpoint vLLM loads (a fine-tune rewritten in place, sizes and mtimes
kept, is another model), the model dtype and the quantization; a request's first block is
rooted in the fingerprint and its `cache_salt`, as our engine roots it, with SHA-256."""

from __future__ import annotations

import os

import pytest
import torch

from tierguard.common.errors import TierguardError
from tierguard.engine.prefix_hash import prefix_block_hashes, root_hash
from tierguard.integrations.vllm.layout import (
    RequestHashes,
    checkpoint_digest,
    geometry_from_spec,
    request_salt,
    vllm_fingerprint,
)
from tierguard.kv.spec import fingerprint_salt

GEOMETRY = geometry_from_spec(["l0", "l1"], 16, 2, 64, torch.bfloat16, 16 * 2 * 64 * 2 * 2)


def test_the_fingerprint_follows_the_checkpoint_content_dtype_and_quantization(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    f = ckpt / "model.safetensors"
    f.write_bytes(bytes(range(256)) * 64)
    (ckpt / "config.json").write_text("{}")
    before = checkpoint_digest(str(ckpt))
    fp = vllm_fingerprint(before, {"hidden_size": 128}, GEOMETRY, "torch.bfloat16", "")
    st = os.stat(f)
    with open(f, "r+b") as fh:  # a fine-tune dropped in: same name, size and mtime
        fh.seek(1000)
        fh.write(b"\xff\xfe")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = checkpoint_digest(str(ckpt))
    assert after != before
    assert vllm_fingerprint(after, {"hidden_size": 128}, GEOMETRY, "torch.bfloat16", "") != fp
    assert vllm_fingerprint(before, {"hidden_size": 128}, GEOMETRY, "torch.float16", "") != fp
    assert vllm_fingerprint(before, {"hidden_size": 128}, GEOMETRY, "torch.bfloat16", "awq") != fp
    assert vllm_fingerprint(before, {"hidden_size": 128}, GEOMETRY, "torch.bfloat16", "") == fp
    (tmp_path / "empty").mkdir()
    with pytest.raises(TierguardError, match="no weight files"):
        checkpoint_digest(str(tmp_path / "empty"))


def test_request_hashes_are_rooted_in_the_fingerprint_and_the_cache_salt():
    fp = "0123456789abcdef"
    tokens = list(range(64))
    plain = RequestHashes(request_salt(fp, None), 16).upto(tokens, 64)
    assert plain == prefix_block_hashes(tokens, 16, fingerprint_salt(fp))  # our engine's chain, SHA-256
    salted = RequestHashes(request_salt(fp, "tenant-a"), 16).upto(tokens, 64)
    assert request_salt(fp, "tenant-a") == root_hash(fingerprint_salt(fp), "tenant-a")
    assert not set(salted) & set(plain)
    assert not set(salted) & set(RequestHashes(request_salt(fp, "tenant-b"), 16).upto(tokens, 64))
