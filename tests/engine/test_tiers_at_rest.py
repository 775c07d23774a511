"""Cold KV at rest through the engine: a prefix written with key A is a counted miss with
key B (recomputed, same greedy output, the files untouched) and a disk hit with key A
again; the block files hold no 64-byte run of the KV they seal; serve's flags reach the
tier. A real `tierguard serve` restarted with each key is the slow test at the end."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import pytest

from tests.engine.conftest import make_engine, prompt_ids
from tests.engine.test_tiers import run
from tests.kv.test_kv_at_rest import shares_a_run
from tierguard.cli.serve import READY_PREFIX
from tierguard.common.proc import ReadyProcess
from tierguard.engine.api import SamplingParams
from tierguard.kv.media.aead_codec import AesGcmCodec
from tierguard.kv.media.disk.tier import DiskTier

PROMPT = [prompt_ids(300, 61)]  # 15 full blocks of 4 tokens
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    d.mkdir(mode=0o700)
    out = {}
    for name in ("A", "B"):
        (d / name).write_bytes(os.urandom(32))
        (d / name).chmod(0o600)
        out[name] = str(d / name)
    return out


def _files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*.kvb"))}


def test_prefix_with_key_a_misses_with_key_b_and_hits_with_key_a_again(tiny_dir, tmp_path, keys):
    tiers = dict(kv_host_gib=0.01, kv_disk_dir=str(tmp_path / "kv"), kv_disk_gib=0.05)
    reference = run(make_engine(tiny_dir), PROMPT, GREEDY)

    first = make_engine(tiny_dir, kv_encrypt_key_file=keys["A"], **tiers)
    assert isinstance(first.connector.media["disk"].codec, AesGcmCodec)
    assert run(first, PROMPT, GREEDY) == reference
    first.close()
    persisted = first.stats().flat()["kv_persisted_blocks"]
    assert persisted >= 15
    files = _files(tmp_path / "kv")
    assert len(files) == persisted

    # The files hold no 64-byte run of the KV they seal (read back through key A).
    reader = DiskTier(tmp_path / "kv", first.fingerprint, 1 << 30, codec=AesGcmCodec.from_files(keys["A"]))
    for name, raw in files.items():
        plain = reader.read(int(name.removesuffix(".kvb"), 16))
        assert plain is not None and not shares_a_run(plain, raw)
    reader.close()

    wrong = make_engine(tiny_dir, kv_encrypt_key_file=keys["B"], **tiers)
    try:
        assert run(wrong, PROMPT, GREEDY) == reference  # recomputed, same greedy output
        x = wrong.stats().flat()
        assert x["kv_disk_undecodable"] >= 1 and x["kv_stage_failures"] >= 1  # counted
        assert x["kv_disk_hits"] == 0 and x["kv_blocks_loaded_from_disk"] == 0
    finally:
        wrong.close()
    assert wrong.stats().flat()["kv_disk_rejected_writes"] >= 1  # its write-behind did not overwrite
    assert _files(tmp_path / "kv") == files  # not one byte changed

    again = make_engine(tiny_dir, kv_encrypt_key_file=keys["A"], **tiers)
    try:
        assert run(again, PROMPT, GREEDY) == reference
        x = again.stats().flat()
        assert x["kv_disk_hits"] > 0 and x["kv_blocks_loaded_from_disk"] > 0
        assert x["kv_disk_undecodable"] == 0
    finally:
        again.close()


def test_serve_flags_reach_the_disk_tier(tiny_dir, tmp_path, keys):
    from tierguard.engine.factory import build_engine
    from tierguard.serve.tier_flags import add_tier_flags, tier_kwargs

    p = argparse.ArgumentParser()
    add_tier_flags(p)
    args = p.parse_args(
        ["--kv-host-gib", "0.01", "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "0.01",
         "--kv-encrypt-key-file", keys["B"], "--kv-encrypt-old-key-file", keys["A"],
         "--kv-disk-ttl-s", "3600"]
    )  # fmt: skip
    engine = build_engine(tiny_dir, dtype="float32", device="cpu", kv_cache_gib=0.01, max_model_len=128,
                          block_size=4, **tier_kwargs(args))  # fmt: skip
    try:
        disk = engine.connector.media["disk"]
        codec = AesGcmCodec.from_files(keys["B"], [keys["A"]])
        assert (disk.codec.key_id, disk.codec.key_ids) == (codec.key_id, codec.key_ids)
        assert disk.ttl_s == 3600
    finally:
        engine.close()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-encrypt-key-file", "{loose}"], "group or others"),
        (["--kv-encrypt-key-file", "{root}/absent"], "cannot read key file"),
        (["--kv-encrypt-old-key-file", "{A}"], "needs --kv-encrypt-key-file"),
        (["--kv-disk-ttl-s", "-1"], "non-negative"),
        (["--kv-encrypt-key-file", "{A}", "--kv-naive-sync-disk"], "unencrypted"),
    ],
)
def test_bad_at_rest_flags_are_one_line_exit_2_before_the_model_loads(tmp_path, keys, capsys, flags, message):
    from tierguard.cli.main import main

    loose = tmp_path / "loose"
    loose.write_bytes(os.urandom(32))
    loose.chmod(0o640)
    argv = [f.format(loose=loose, root=tmp_path, A=keys["A"]) for f in flags]
    code = main(["serve", "--model", str(tmp_path / "no-model-here"), "--kv-disk-dir", str(tmp_path / "kv"),
                 "--kv-disk-gib", "0.1", *argv])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


# ---- the real server, restarted with each key (slow: three server starts) ----


def _serve(disk, key: str, log) -> ReadyProcess:
    cmd = [
        sys.executable, "-m", "tierguard", "serve", "--model", "tiny", "--port", "0",
        "--max-model-len", "1024", "--kv-cache-gib", "0.02", "--log-level", "info",
        "--kv-host-gib", "0.02", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.1",
        "--kv-encrypt-key-file", key,
    ]  # fmt: skip
    return ReadyProcess(cmd, READY_PREFIX, stderr_path=log)


@pytest.mark.slow
def test_a_real_server_restarted_with_key_b_recomputes_and_with_key_a_hits(tmp_path, keys):
    from tests.engine.test_tiers_serve import _complete, _gauge

    disk, prompt = tmp_path / "kv", prompt_ids(5, 300, vocab=4000)
    texts, metrics = [], []
    for i, key in enumerate((keys["A"], keys["B"], keys["A"])):
        with _serve(disk, key, tmp_path / f"server{i}.log") as server:
            url = server.start(timeout_s=300).split()[0]
            text, m = asyncio.run(_complete(url, prompt, wait_persisted=i == 0))
        texts.append(text)
        metrics.append(m)
        if i == 0:
            files = _files(disk)
            assert files and len(files) == _gauge(m, "tierguard:engine_kv_persisted_blocks_total")
    assert texts[1] == texts[0] == texts[2]
    first, wrong, again = metrics
    assert _gauge(wrong, "tierguard:engine_kv_disk_undecodable_total") >= 1
    assert _gauge(wrong, "tierguard:engine_kv_disk_hits_total") == 0
    assert _gauge(again, "tierguard:engine_kv_disk_hits_total") > 0
    assert _gauge(again, "tierguard:engine_kv_disk_undecodable_total") == 0
    assert _files(disk) == files  # the key-B server changed nothing on disk
    assert "AES-256-GCM, key" in (tmp_path / "server0.log").read_text()
