"""The host slab both vLLM processes map: room taken at start, ownership by lock.

Real files, a real filesystem's free space, real subprocesses holding a slab; a real small
tmpfs where the test may mount one (root), skipped elsewhere, while the default suite
keeps a real test of the same error path (more than the filesystem has free).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.kv.pidns import pid_namespace_argv
from tierguard.common.errors import TierguardError
from tierguard.integrations.vllm import shm
from tierguard.integrations.vllm.scheduler import TierScheduler

from .harness import FP, config, geometry

ROOT = Path(__file__).resolve().parents[2]


def _gone_pid() -> int:
    """A pid no process has here, like a process's pid seen from another PID namespace."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_slab_is_allocated_whole_at_start_not_sparse(tmp_path):
    path = shm.slab_path(str(tmp_path), "e", os.getpid())
    slab = shm.create_slab(path, 64, 64 << 10)
    st = os.stat(path)
    assert st.st_size == 4 << 20 and st.st_blocks * 512 >= st.st_size  # the pages are there
    assert slab.shape == (64, 64 << 10) and int(slab.sum()) == 0
    slab[3].fill_(7)  # shared with a second mapping, as the worker maps it
    assert int(shm.open_slab(path, 64, 64 << 10)[3][0]) == 7


def test_more_than_the_filesystem_has_free_is_one_line_error_at_start(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    path = shm.slab_path(str(tmp_path), "e", os.getpid())
    rows = (free + (1 << 30)) // (1 << 20)
    with pytest.raises(TierguardError) as e:
        shm.create_slab(path, rows, 1 << 20)
    msg = str(e.value)
    assert "\n" not in msg and "needs" in msg and "free" in msg and str(tmp_path) in msg
    assert "kv_host_gib" in msg and "--shm-size" in msg
    assert not path.exists()  # nothing left behind


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 MiB tmpfs, Docker's default /dev/shm (root only; skipped elsewhere)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # -l: even if a test left it busy


def test_kv_host_gib_1_on_a_64_mib_shm_fails_at_start_in_one_line(tmp_path, small_tmpfs):
    cfg = config(tmp_path, kv_host_gib=1)  # host_shm_dir is tmp_path/"shm", the tmpfs
    with pytest.raises(TierguardError) as e:
        TierScheduler(cfg, FP, geometry().block_bytes, "e")
    msg = str(e.value)
    assert "\n" not in msg and "1.0 GiB" in msg and "64.0 MiB" in msg and str(small_tmpfs) in msg
    assert os.listdir(small_tmpfs) == []


def test_a_slab_that_fits_the_free_space_but_not_the_tmpfs_is_refused_by_allocation(small_tmpfs):
    """Free space checked first can still run out before the pages are taken (another
    process's file): the allocation itself says so, in the same one line."""
    filler = small_tmpfs / "other"
    with open(filler, "wb") as f:
        f.write(bytes(40 << 20))
    path = shm.slab_path(str(small_tmpfs), "e", os.getpid())
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(TierguardError) as e:
            shm._allocate_and_map(fd, path, 32, 1 << 20)  # 32 MiB > the 24 MiB left
    finally:
        os.close(fd)
    assert "needs 32.0 MiB" in str(e.value) and not path.exists()


def test_an_overflowing_pid_in_a_name_is_left_alone_and_start_works(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    odd = shm_dir / "tierguard-kv-x-99999999999999999999"
    odd.touch()
    sched = TierScheduler(config(tmp_path), FP, geometry().block_bytes, "e")
    try:
        assert odd.exists()  # not a name the connector makes: not ours to remove
        assert sched.slab_path.exists()
    finally:
        sched.close()


_HOLDER = textwrap.dedent(
    """
    import os, sys
    from tierguard.integrations.vllm import shm
    pid = os.getpid() if sys.argv[2] == "self" else int(sys.argv[2])
    path = shm.slab_path(sys.argv[1], "other-engine", pid)
    slab = shm.create_slab(path, 4, 4096)
    print(path, flush=True)
    sys.stdin.read()  # hold the slab until the test lets go
    """
)


def _hold_slab(
    directory: Path, pid_in_name: int | str, prefix: list[str] | None = None
) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [*(prefix or []), sys.executable, "-c", _HOLDER, str(directory), str(pid_in_name)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    return p, Path(p.stdout.readline().strip())


def test_a_live_owners_slab_is_never_removed_whatever_its_pid_says(tmp_path):
    """The owner's pid in the name is one this namespace does not have (a container
    sharing /dev/shm): a pid check calls it dead; its lock says it is alive."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    holder, path = _hold_slab(shm_dir, _gone_pid())
    try:
        assert path.exists()
        assert shm.remove_stale(str(shm_dir)) == 0
        sched = TierScheduler(config(tmp_path), FP, geometry().block_bytes, "e")  # starts beside it
        sched.close()
        assert path.exists()
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_live_owner_in_another_pid_namespace_keeps_its_slab(tmp_path):
    """A container sharing /dev/shm (--ipc=host): the owner names the slab with its own
    pid, which this namespace does not have (root only)."""
    ns = pid_namespace_argv()
    if ns is None:
        pytest.skip("needs root and unshare to make a PID namespace")
    prefix, pid_inside = ns
    holder, path = _hold_slab(tmp_path, "self", prefix)
    try:
        assert f"-{pid_inside}" in path.name
        assert shm.remove_stale(str(tmp_path)) == 0 and path.exists()
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_stale_slab_whose_owner_was_killed_is_reclaimed(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    holder, path = _hold_slab(shm_dir, os.getpid())  # even a live pid in the name
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdin.close()
    assert path.exists()
    assert shm.remove_stale(str(shm_dir)) == 1 and not path.exists()


def test_a_slab_is_owned_for_as_long_as_its_tensor_lives(tmp_path):
    path = shm.slab_path(str(tmp_path), "e", os.getpid())
    slab = shm.create_slab(path, 2, 4096)
    assert shm.remove_stale(str(tmp_path)) == 0  # another open in this process conflicts too
    del slab
    assert shm.remove_stale(str(tmp_path)) == 1
