"""`kv_connector_extra_config` is JSON a user writes by hand: "nan", "inf", a directory the
process cannot write and absurd counts are each one clear error naming the option as the
user wrote it, before vLLM loads a model (and serve's flags refuse the same numbers)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess

import pytest

from tierguard.common.errors import TierguardError
from tierguard.integrations.vllm.config import BOUNDS, parse_config
from tierguard.serve.tier_flags import add_tier_flags, tier_kwargs

FLOATS = ("kv_host_gib", "kv_disk_gib", "kv_disk_ttl_s", "kv_remote_ttl_s", "kv_remote_gib", "kv_remote_timeout_ms")


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), float("inf")])
def test_nan_and_inf_are_refused_by_name(name, value):
    options = {"kv_disk_dir": "/tmp/unused", "kv_disk_gib": 1, "kv_remote_url": "redis://h:1/0", name: value}
    with pytest.raises(TierguardError) as e:
        parse_config(options)
    assert str(e.value).startswith(f"{name} must be a finite number"), e.value


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_ttft_budgets_must_be_real_times(value):
    with pytest.raises(TierguardError, match="ttft_budget_ms: budget for batch must be a positive number"):
        parse_config({"ttft_budget_ms": {"batch": value}})


@pytest.mark.parametrize(("name", "value"), [("transfer_threads", 1e9), ("transfer_threads", float("inf")),
                                             ("store_queue_blocks", 10**9), ("metrics_port", 70000)])
def test_counts_have_documented_bounds(name, value):
    with pytest.raises(TierguardError) as e:
        parse_config({name: value})
    assert str(e.value).startswith(name), e.value
    least, most = BOUNDS[name]
    assert parse_config({name: most}) is not None and parse_config({name: least}) is not None


@contextlib.contextmanager
def read_only_dir(path):
    """A directory nobody can create files in: a read-only tmpfs when root (permission bits
    do not stop root), else mode 0500."""
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True).returncode == 0
    if not mounted:
        path.chmod(0o500)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        else:
            path.chmod(0o700)


def test_a_directory_the_process_cannot_write_is_refused_by_name(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(TierguardError, match=r"^kv_disk_dir '.*ro' is not a writable directory"):
            parse_config({"kv_disk_dir": str(ro), "kv_disk_gib": 1})
        with pytest.raises(TierguardError, match=r"^kv_disk_dir '.*sub' is not a writable directory"):
            parse_config({"kv_disk_dir": str(ro / "sub"), "kv_disk_gib": 1})  # would be made there
        with pytest.raises(TierguardError, match=r"^host_shm_dir '.*ro' is not a writable directory"):
            parse_config({"host_shm_dir": str(ro)})
    made = tmp_path / "kv" / "disk"
    cfg = parse_config({"kv_disk_dir": str(made), "kv_disk_gib": 1, "host_shm_dir": str(tmp_path)})
    assert cfg.media["disk"]["dir"] == str(made) and made.is_dir() and not list(made.iterdir())


@pytest.mark.parametrize("flag", ["--kv-host-gib", "--kv-disk-gib", "--kv-remote-gib", "--kv-remote-ttl-s",
                                  "--kv-remote-timeout-ms", "--kv-disk-ttl-s"])
def test_serve_tier_flags_refuse_nan_and_inf(flag):
    p = argparse.ArgumentParser()
    add_tier_flags(p)
    for value in ("nan", "inf"):
        args = p.parse_args(["--kv-host-gib", "1", "--kv-remote-url", "redis://h:1/0", flag, value])
        with pytest.raises(TierguardError, match=f"^{flag} must be a finite number"):
            tier_kwargs(args)
