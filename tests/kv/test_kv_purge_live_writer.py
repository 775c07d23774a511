"""`tierguard kv purge` leaves a live writer's temporary files alone and removes a dead
writer's. The writers are real processes with a real `DiskTier`, each stopped in the
middle of writing a block (its temporary file on disk, not yet renamed): one was SIGKILLed
before purge runs, the other is still running when purge runs. Behaviour only, whatever tells a
live writer from a dead one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tierguard.cli.main import main
from tierguard.kv.media.disk import format as fmt

FP = "a1b2c3d4e5f60718"
ROOT = Path(__file__).resolve().parents[2]

# A disk tier's write held after the block's header reached the temporary file: it says
# so on stdout and waits for a line on stdin (or for SIGKILL).
WRITER = """
import sys
import torch
from tierguard.kv.media.disk.tier import DiskTier

real = DiskTier._write_all
held = []

def write_all(fd, mv):
    real(fd, mv)
    if not held:
        held.append(True)
        print("IN FLIGHT", flush=True)
        sys.stdin.readline()

DiskTier._write_all = staticmethod(write_all)
tier = DiskTier(sys.argv[1], sys.argv[2], 1 << 20)
print("WROTE" if tier.write(int(sys.argv[3]), torch.ones(4096, dtype=torch.uint8)) else "FAILED", flush=True)
tier.close()
"""


def writer(root: Path, block_hash: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), FP, str(block_hash)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "IN FLIGHT"
    return p


def temps(root: Path) -> set[str]:
    return {n for n in os.listdir(root / FP) if fmt.TEMP_RE.match(n)}


def purge(root: Path, capsys) -> None:
    assert main(["kv", "purge", str(root), "--fingerprint", FP]) == 0
    capsys.readouterr()


def test_purge_leaves_a_live_writers_temporary_file_and_removes_a_dead_ones(tmp_path, capsys):
    procs = [dead := writer(tmp_path, 2)]
    try:
        (dead_temp,) = temps(tmp_path)
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        purge(tmp_path, capsys)
        assert temps(tmp_path) == set()  # a dead writer's temporary file is a leftover: removed

        procs.append(live := writer(tmp_path, 1))  # one server per directory: it starts once the dead one is gone
        (live_temp,) = temps(tmp_path)
        purge(tmp_path, capsys)
        assert temps(tmp_path) == {live_temp}  # the live writer's is kept
        purge(tmp_path, capsys)  # and again: a live writer's file is never a leftover
        assert temps(tmp_path) == {live_temp}

        live.stdin.write("go\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "WROTE"  # it finished the block it was writing
        assert live.wait(30) == 0
        assert temps(tmp_path) == set() and (tmp_path / FP / fmt.block_name(1)).is_file()
        assert not (tmp_path / FP / fmt.block_name(2)).exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
