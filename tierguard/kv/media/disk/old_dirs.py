"""Directories of other fingerprints under the disk tier's root: old models' blocks.

A model upgrade (new weights, dtype, block size) changes the fingerprint, so the blocks
of the old one stay behind in `<root>/<old fingerprint>/` and nothing will read them
until that model comes back. The tier holds the root's lock (owner.py: one server per
directory), so no live server owns them: they count against the budget, and when it
needs room they go first, oldest file first (their mtime is their last use), before any
block of the running model. A directory is removed once the files it held are gone.

Only what the tier named is counted or removed: `<64 hex>.kvb` files (and `<16 hex>.kvb`, the
previous format's names, left by an upgrade) and temporary files,
regular files only; symlinks, other names and subdirectories are left alone (and with
them the directory that holds them). Scanned once at start: while the lock is held
nobody else writes there, and a file an operator removes meanwhile is subtracted when
its turn comes.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field

from tierguard.kv.media.disk import format as fmt
from tierguard.kv.spec import is_fingerprint

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | fmt.OPEN_FLAGS


@dataclass(order=True)
class OldFile:
    mtime: float
    fingerprint: str
    name: str
    size: int = field(compare=False, default=0)
    last: bool = field(compare=False, default=False)  # its directory's last counted file


class OldDirs:
    """The old fingerprints' files, oldest first. Counting is not thread-safe (the tier's
    lock guards `pop_oldest`); `remove` does the I/O, outside that lock."""

    def __init__(self, root: str | None, own: str) -> None:
        """Scan `root` for other fingerprints than `own` (None: count nothing)."""
        self.bytes = 0
        self._heap: list[OldFile] = []
        self._left: dict[str, int] = {}  # fingerprint -> files still counted
        self._root_fd: int | None = None
        if root is None:
            return
        try:
            self._root_fd = os.open(root, _DIR_FLAGS)
            names = [e.name for e in os.scandir(self._root_fd) if is_fingerprint(e.name) and e.name != own]
        except OSError:
            self._root_fd, names = None, []
        for fp in names:
            self._scan(fp)
        heapq.heapify(self._heap)

    def _scan(self, fp: str) -> None:
        try:
            dir_fd = os.open(fp, _DIR_FLAGS, dir_fd=self._root_fd)
        except OSError:
            return  # a symlink, a file, unreadable: not ours
        try:
            for entry in os.scandir(dir_fd):
                if not (fmt.BLOCK_RE.match(entry.name) or fmt.PREVIOUS_BLOCK_RE.match(entry.name)
                        or fmt.is_temp_name(entry.name)):
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                self._heap.append(OldFile(st.st_mtime, fp, entry.name, st.st_size))
                self._left[fp] = self._left.get(fp, 0) + 1
                self.bytes += st.st_size
        except OSError:
            pass
        finally:
            os.close(dir_fd)

    @property
    def num_dirs(self) -> int:
        return len(self._left)

    def pop_oldest(self) -> OldFile | None:
        """Take the oldest file off the count; the caller passes it to `remove`."""
        if not self._heap:
            return None
        f = heapq.heappop(self._heap)
        self.bytes -= f.size
        self._left[f.fingerprint] -= 1
        if not self._left[f.fingerprint]:
            del self._left[f.fingerprint]
            f.last = True
        return f

    def remove(self, victims: list[OldFile]) -> int:
        """Unlink popped files, then each directory they emptied (one that still holds
        something else stays); returns how many files were removed (one already gone is
        not counted)."""
        removed = 0
        for f in victims:
            try:
                dir_fd = os.open(f.fingerprint, _DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:
                continue
            try:
                os.unlink(f.name, dir_fd=dir_fd)
                removed += 1
            except OSError:
                pass
            finally:
                os.close(dir_fd)
            if f.last:
                try:
                    os.rmdir(f.fingerprint, dir_fd=self._root_fd)
                except OSError:
                    pass
        return removed

    def close(self) -> None:
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None
