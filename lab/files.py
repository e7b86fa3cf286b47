"""The one way the lab writes a result file (a CSV or Parquet table, a profile, a sweep's outputs, a child's answer):
atomically. The content goes to a temporary file of a unique name in the target's folder, is flushed and synced to
disk, then renamed over the target (``os.replace``). A reader, a full disk or an interrupted run never sees a file
written half, and two writers of one path each leave one whole file: the last rename wins. The temporary file is
removed on any failure. And a file's identity by its content (``file_digest``): what keys runs that read a file (a
trace, a kernel CSV, a profile), so that a rewritten file is a new run, never the stale one kept under its path."""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from .errors import InputError

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import (os.umask can only be read by setting it, which is not thread-safe)


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(temporary)`` to write the content to a path of a unique name beside ``path`` (folders created),
    then sync it and rename it to ``path``. On any failure (``write`` raising, a full disk, an interrupt) ``path``
    keeps its old content and the temporary file is removed."""
    path = Path(path)
    if path.is_symlink():  # write through a link to the file it names, as a plain write would
        path = path.resolve()
    if path.exists() and not path.is_file():  # a device or a pipe would be replaced by a file
        raise InputError(f"{path} is not a regular file (a device or a pipe); write results to a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        _sync(temporary)
        os.chmod(temporary, _mode_for(path))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def write_text_atomically(path: str | Path, text: str) -> None:
    """``write_atomically`` for a text (UTF-8)."""
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def write_bytes_atomically(path: str | Path, data: bytes) -> None:
    """``write_atomically`` for bytes."""
    write_atomically(path, lambda temporary: temporary.write_bytes(data))


def _mode_for(path: Path) -> int:
    """The permissions ``path`` has, or a new file's (``mkstemp`` makes its files private to their owner)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~_UMASK


def _sync(path: Path) -> None:
    """Flush ``path``'s content to the disk: a crash after the rename must not leave an empty file."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable where the system allows syncing a folder (not on Windows)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


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
