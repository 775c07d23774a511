"""`tierguard kv purge`: an operator deletes disk-tier blocks, by age or all of them.

Who deletes what is part of the cold contract (docs/cold-contract.md): the server itself
removes blocks to stay within its byte budget and, with `--kv-disk-ttl-s`, blocks not
used for that long. This is the third way, for people: a retention rule run from cron,
a model retired, a data-residency request. The rules it keeps:

- It removes only what the disk tier named: `<DIR>/<fingerprint>/<hash>.kvb` files whose
  header is an intact block of that fingerprint and hash, and temporary files of dead
  writers. Anything else (other names, torn or foreign files, symlinks, other
  directories) is left alone and counted, so pointing it at the wrong directory deletes
  nothing.
- A writer is alive while a server holds `DIR/tierguard.lock` (owner.py), in whatever
  PID namespace; the pid in a temporary file's name is not consulted. While one does, no
  temporary file is touched (counted as in flight); otherwise purge removes them holding
  that lock, so a server starting meanwhile waits for it instead of writing beside it.
- "Older than" means not written or read for that long: a server touches a block's mtime
  on every read hit, the same clock as its own TTL sweeper.
- Safe while a server runs: a block removed under it is a miss (recomputed), and the
  server forgets it on that read.

No torch, no engine: it reads headers only.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from tierguard.common.errors import TierguardError
from tierguard.kv.media.block_format import is_fingerprint
from tierguard.kv.media.disk import format as fmt
from tierguard.kv.media.disk import owner

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | fmt.OPEN_FLAGS


@dataclass
class PurgeReport:
    """What one fingerprint directory held and what was (or would be) removed."""

    directory: str
    removed: int = 0
    removed_bytes: int = 0
    kept: int = 0  # intact blocks newer than the cut-off
    leftovers: int = 0  # dead writers' temporary files removed
    in_flight: int = 0  # temporary files of a live server, left alone
    left_alone: int = 0  # names the tier did not write, torn or foreign files, symlinks

    def line(self, dry_run: bool, older_than: str | None) -> str:
        verb = "would remove" if dry_run else "removed"
        what = f"{verb} {self.removed} block files ({self.removed_bytes / 2**20:.1f} MiB)"
        if self.leftovers:
            what += f" and {self.leftovers} temporary files"
        rest = [f"kept {self.kept} used within {older_than}"] if older_than else []
        if self.in_flight:
            rest.append(f"left {self.in_flight} temporary files of the running server alone")
        if self.left_alone:
            rest.append(
                f"left {self.left_alone} other {'entry' if self.left_alone == 1 else 'entries'} alone"
            )
        return f"{what} from {self.directory}" + (f"; {', '.join(rest)}" if rest else "")


def tier_dirs(root: str, fingerprint: str | None = None) -> list[str]:
    """The fingerprint directories under `root` (all, or the one named); TierguardError
    for a root that is not a real directory or a fingerprint that is not there."""
    if fingerprint is not None and not is_fingerprint(fingerprint):
        raise TierguardError(f"--fingerprint must be 16 lowercase hex characters, got {fingerprint!r}")
    try:
        st = os.lstat(root)
    except OSError as e:
        raise TierguardError(f"cannot read {root!r}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise TierguardError(f"{root!r} is not a directory (a symlink is not followed)")
    found = sorted(
        e.name for e in os.scandir(root) if is_fingerprint(e.name) and e.is_dir(follow_symlinks=False)
    )
    if fingerprint is None:
        return found
    if fingerprint not in found:
        have = ", ".join(found) or "none"
        raise TierguardError(f"no KV tier directory {fingerprint} under {root!r} (found: {have})")
    return [fingerprint]


def purge_dir(
    root: str, fingerprint: str, older_than_s: float | None, dry_run: bool, now: float | None = None
) -> PurgeReport:
    """Remove (or count, with `dry_run`) the blocks of one fingerprint directory."""
    path = os.path.join(root, fingerprint)
    report = PurgeReport(path)
    cutoff = None if older_than_s is None else (time.time() if now is None else now) - older_than_s
    dir_fd = os.open(path, _DIR_FLAGS)
    temps: list[str] = []
    try:
        for entry in os.scandir(dir_fd):
            if not entry.is_file(follow_symlinks=False):
                report.left_alone += 1
                continue
            if fmt.is_temp_name(entry.name):
                temps.append(entry.name)
                continue
            m = fmt.BLOCK_RE.match(entry.name)
            header = m and fmt.validate_file(dir_fd, entry.name, fingerprint, int(m.group(1), 16))
            if not header:
                report.left_alone += 1  # includes names out of range for a temporary file
                continue
            st = entry.stat(follow_symlinks=False)
            if cutoff is not None and st.st_mtime >= cutoff:
                report.kept += 1
                continue
            report.removed += 1
            report.removed_bytes += st.st_size
            _remove(dir_fd, entry.name, dry_run)
        if temps:
            with owner.dir_free(root) as free:  # held while removing: no server starts meanwhile
                if free:
                    report.leftovers = len(temps)
                    for name in temps:
                        _remove(dir_fd, name, dry_run)
                else:
                    report.in_flight = len(temps)
    finally:
        os.close(dir_fd)
    return report


def _remove(dir_fd: int, name: str, dry_run: bool) -> None:
    if dry_run:
        return
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass  # a running server removed it first
