"""A file's identity by its content: what keys runs that read a file (a trace, a kernel CSV, a profile), so that a
rewritten file is a new run, never the stale one kept under its path."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (cached while its inode, size and modification and change times stay the same)."""
    stat = Path(path).stat()
    return _digest(str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@lru_cache(maxsize=64)
def _digest(path: str, inode: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
