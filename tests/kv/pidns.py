"""Run a command in a new PID namespace, as a container does, under a pid this namespace
has no process for: what a process sharing /dev/shm or a disk directory from another
container looks like to us. Needs root and util-linux `unshare`; None where it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess


def pid_namespace_argv() -> tuple[list[str], int] | None:
    """(argv prefix, the pid the command will have inside), or None if unavailable."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    base = ["unshare", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*base, "true"], capture_output=True).returncode:
        return None
    with open("/proc/sys/kernel/pid_max") as f:
        last = int(f.read()) - 20
    try:
        os.kill(last + 1, 0)
        return None  # that pid is taken here too: the test would prove nothing
    except ProcessLookupError:
        pass
    except PermissionError:
        return None
    # sh is pid 1 inside; it forks the command (not exec: it is not the last word) as last + 1
    script = f'echo {last} > /proc/sys/kernel/ns_last_pid && "$@"; exit $?'
    return [*base, "sh", "-c", script, "sh"], last + 1
