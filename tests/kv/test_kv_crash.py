"""kill -9 during a write, then restart: the index is consistent and no partial block is readable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk.tier import DiskTier

from .conftest import FP, payload

CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    from tierguard.kv.media.disk.tier import DiskTier

    root, mode, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def data(h):
        g = torch.Generator().manual_seed(h)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

    tier = DiskTier(root, "0123456789abcdef", 1 << 34)
    if mode == "mid":
        for h in (1, 2, 3):
            tier.write(h, data(h))
        real = DiskTier._write_all

        def half_then_stop(fd, mv):
            if mv.nbytes == nbytes:  # the payload of block 4: write half, then wait to be killed
                real(fd, mv[: nbytes // 2])
                print("MID", flush=True)
                time.sleep(60)
            real(fd, mv)

        DiskTier._write_all = staticmethod(half_then_stop)
        tier.write(4, data(4))
    else:
        print("GO", flush=True)
        h = 1
        while True:
            tier.write(h, data(h))
            h += 1
    """
)


def spawn(root, mode: str, nbytes: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()


def test_kill_during_write_leaves_no_partial_block(tmp_path):
    nbytes = 1 << 16
    proc = spawn(tmp_path, "mid", nbytes)
    assert proc.stdout.readline().strip() == "MID"
    temps = [n for n in os.listdir(tmp_path / FP) if n.startswith(".tmp-")]
    assert len(temps) == 1  # the half-written block exists, under a temporary name
    kill9(proc)
    tier = DiskTier(tmp_path, FP, 1 << 30)
    assert [tier.contains(h) for h in (1, 2, 3, 4)] == [True, True, True, False]
    assert tier.stats().cleaned_on_start == 1
    assert [n for n in os.listdir(tmp_path / FP) if n.startswith(".tmp-")] == []
    for h in (1, 2, 3):
        assert tier.read(h) == bytes(payload(h, nbytes).numpy())
    assert tier.read(4) is None


def test_kill_at_a_random_moment_then_restart_is_consistent(tmp_path):
    nbytes = 1 << 18
    proc = spawn(tmp_path, "loop", nbytes)
    assert proc.stdout.readline().strip() == "GO"
    deadline = time.monotonic() + 10
    while len(os.listdir(tmp_path / FP)) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    kill9(proc)
    tier = DiskTier(tmp_path, FP, 1 << 34)
    names = os.listdir(tmp_path / FP)
    assert not any(n.startswith(".tmp-") for n in names)
    indexed = [h for h in range(1, 10_000) if tier.contains(h)]
    assert len(indexed) >= 5 and len(indexed) == len(names)
    for h in indexed:
        assert os.path.getsize(tmp_path / FP / fmt.block_name(h)) == fmt.HEADER_LEN + nbytes
        assert tier.read(h) == bytes(payload(h, nbytes).numpy())
    s = tier.stats()
    assert s.corrupt == 0 and s.hits == len(indexed)
