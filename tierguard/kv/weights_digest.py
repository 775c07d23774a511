"""A digest of a checkpoint's weight bytes, for the KV fingerprint (tierguard/kv/spec.py).

KV is a function of the weights, so the fingerprint that names stored blocks must change
when the weights do. Names, sizes and modification times do not: a fine-tune dropped into
the same directory has the same sizes, and image builds set every mtime to one value.
So the fingerprint carries the SHA-256 of each weight file's content.

Hashing gigabytes at every start would slow restarts, so each file's digest is kept in
`$TIERGUARD_CACHE/weights/` (default ~/.cache/tierguard), one small JSON record per file,
keyed by its real path and valid only while its device, inode, size, mtime_ns and
ctime_ns are unchanged. ctime cannot be set back by a user (`os.utime` moves it), so a
file rewritten in place and given its old mtime is hashed again. Timestamps are coarse
(a few ms), so a file changed less than RACY_S before it was hashed is not cached (git's
"racy" rule): a change within the same tick could not be told from the hashed state. A
cache that cannot be read or written only costs the hashing; it never changes the digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from tierguard.common.errors import TierguardError

log = logging.getLogger("tierguard.kv.weights")

CHUNK = 8 << 20  # bytes per read; hashlib releases the GIL on buffers this large
RACY_S = 2.0  # a file changed this recently when hashed is hashed again next time
# What a checkpoint directory's weights are, in the order a loader prefers them.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")


def cache_dir() -> Path:
    env = os.environ.get("TIERGUARD_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "tierguard") / "weights"


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digest(path: str | os.PathLike[str], cache: Path | None = None) -> str:
    """SHA-256 (hex) of one file's bytes, from the cache while the file is unchanged."""
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except OSError as e:
        raise TierguardError(f"cannot read weights file {real!r}: {e.strerror}") from None
    root = cache if cache is not None else cache_dir()
    record = root / (hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".json")
    try:
        saved = json.loads(record.read_text())
        if saved.get("path") == real and saved.get("stamp") == _stamp(st) and len(saved.get("sha256", "")) == 64:
            return str(saved["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    log.info("hashing %s (%.1f GiB) for the KV fingerprint", real, st.st_size / 2**30)
    h = hashlib.sha256()
    try:
        with open(real, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    except OSError as e:
        raise TierguardError(f"cannot read weights file {real!r}: {e.strerror}") from None
    digest = h.hexdigest()
    # Not changed while it was read, nor so recently that a change could share its stamp.
    if _stamp(os.stat(real)) == _stamp(st) and time.time() - st.st_ctime_ns / 1e9 >= RACY_S:
        _save(record, {"path": real, "stamp": _stamp(st), "sha256": digest})
    return digest


def _save(record: Path, data: dict) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, record)
    except OSError as e:  # a read-only home: hash again next time
        log.debug("weights digest cache not written (%s): %s", record, e)


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a checkpoint directory: the first pattern of WEIGHT_PATTERNS
    that matches (safetensors before PyTorch pickles, as loaders choose)."""
    d = Path(model_dir)
    for pattern in WEIGHT_PATTERNS:
        files = sorted(p for p in d.glob(pattern) if p.is_file())
        if files:
            return files
    return []


def weights_digest(files: Iterable[str | os.PathLike[str]], cache: Path | None = None) -> str:
    """SHA-256 (hex) naming a checkpoint: its files' names and content digests, in order
    of name. Raises TierguardError when there is no file or one cannot be read."""
    parts = sorted((Path(f).name, file_digest(f, cache)) for f in files)
    if not parts:
        raise TierguardError("no weight files to fingerprint")
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()
