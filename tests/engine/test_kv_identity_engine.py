"""KV is served only to the model and the tenant it belongs to, through a real engine.

- A fine-tune dropped into the model's directory (same file names, sizes and mtimes:
  its weights rewritten in place, the mtime set back) gets no block from the disk or
  Redis blocks the old weights wrote, while the old weights do get them back (control).
- Requests with different `cache_salt`s share no prefix in the device cache, host RAM
  or disk; requests with equal salts do.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.engine.conftest import SMALL, make_engine
from tests.engine.test_tiers import PROMPTS, run
from tests.kv.conftest import wait_until
from tierguard.engine.api import SamplingParams
from tierguard.engine.factory import build_engine
from tierguard.model.tiny import create_tiny

SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, tmp: Path, disk: bool = True, redis_url: str | None = None):
    tiers: dict = {"kv_host_gib": 0.01}
    if disk:
        tiers.update(kv_disk_dir=str(tmp / "kv"), kv_disk_gib=0.05)
    if redis_url:
        tiers["kv_media"] = {"remote": {"url": redis_url, "refresh_s": 0.02, "timeout_ms": 500}}
    return build_engine(model_dir, dtype="float32", device="cpu", kv_cache_gib=0.01, block_size=4,
                        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, **tiers)


def _fine_tune_in_place(model_dir: Path) -> None:
    """Change weights without changing any file's name, size or mtime (an image build)."""
    for f in sorted(model_dir.glob("*.safetensors")):
        st = os.stat(f)
        with open(f, "r+b") as fh:
            fh.seek(st.st_size - 64)
            tail = bytearray(fh.read(64))
            fh.seek(st.st_size - 64)
            fh.write(bytes(b ^ 0x5A for b in tail))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns


def _loaded(engine) -> dict[str, float]:
    x = engine.stats().flat()
    return {k: x.get(k, 0.0) for k in ("kv_blocks_loaded", "kv_disk_hits", "kv_remote_hits")}


def test_a_fine_tune_in_the_same_directory_gets_no_kv_from_disk_or_redis(tmp_path, redis_server):
    model_dir = create_tiny(tmp_path / "model", **SMALL)
    prompts = PROMPTS[:2]
    old = _engine(model_dir, tmp_path, redis_url=redis_server.url)
    run(old, prompts, SHORT)
    old.close()  # the write-behind to disk and Redis ends here
    written = old.stats().flat()
    assert written["kv_disk_writes"] > 0 and written["kv_remote_writes"] > 0
    # Control: the same weights get their blocks back, from the disk and from Redis alone.
    for disk, url, source in ((True, None, "kv_disk_hits"), (False, redis_server.url, "kv_remote_hits")):
        again = _engine(model_dir, tmp_path, disk=disk, redis_url=url)
        if url:
            wait_until(lambda e=again: len(e.connector.media["remote"].index) >= written["kv_remote_writes"])
        run(again, prompts, SHORT)
        assert again.fingerprint == old.fingerprint and _loaded(again)[source] > 0, _loaded(again)
        again.close()
    _fine_tune_in_place(model_dir)
    tuned = _engine(model_dir, tmp_path, redis_url=redis_server.url)
    try:
        assert tuned.fingerprint != old.fingerprint
        assert (tmp_path / "kv" / old.fingerprint).is_dir()  # the old blocks are still there...
        assert tuned.stats().flat()["kv_remote_blocks"] == 0  # (the old model's Redis blocks are not indexed)
        run(tuned, prompts, SHORT)
        assert _loaded(tuned) == {"kv_blocks_loaded": 0, "kv_disk_hits": 0, "kv_remote_hits": 0}, _loaded(tuned)
        bm = tuned.block_manager
        assert bm.prefix_queries > 0 and bm.prefix_hits == 0  # ...and none is served
    finally:
        tuned.close()


def _salted(salt: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt)


def test_cache_salt_partitions_the_prefix_cache_in_every_tier(tiny_dir, tmp_path):
    prompt = PROMPTS[0]
    engine = make_engine(tiny_dir, kv_host_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.05)
    try:
        first = run(engine, [prompt], _salted("tenant-a"))
        hits = engine.block_manager.prefix_hits
        assert run(engine, [prompt], _salted("tenant-b")) == first  # same answer, computed again
        assert engine.block_manager.prefix_hits == hits  # no device hit across salts
        assert run(engine, [prompt], _salted(None)) == first
        assert engine.block_manager.prefix_hits == hits  # nor for the unsalted partition
        run(engine, [prompt], _salted("tenant-a"))
        assert engine.block_manager.prefix_hits > hits  # the same salt shares
        # Below the device: host RAM and disk hold the salted prefixes apart too.
        engine.pool.evict_all_cached()
        before = engine.stats().flat()["kv_blocks_loaded"]
        run(engine, [prompt], _salted("tenant-c"))
        assert engine.stats().flat()["kv_blocks_loaded"] == before
        run(engine, [prompt], _salted("tenant-b"))
        assert engine.stats().flat()["kv_blocks_loaded"] > before
    finally:
        engine.close()
