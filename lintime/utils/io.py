"""Atomic file writes: a temporary file beside the target, flushed, fsynced and renamed over it,
then the folder fsynced, so a reader sees the old file or the new one, never half of one.
The one helper behind the token cache (:mod:`lintime.data.cache`), the tokenizer files and the
run folders (:mod:`lintime.training.checkpoint`, :mod:`lintime.training.metrics`).

Permissions: ``tempfile.mkstemp`` / ``mkdtemp`` (and libraries that write through them, e.g.
safetensors) make private files (0600) and folders (0700).  Whatever a command publishes from
them gets the mode an ordinary ``open()`` / ``mkdir()`` would give, ``0o666 & ~umask`` /
``0o777 & ~umask`` (0644 / 0755 under the usual umask 022): :func:`temp_dir`,
:func:`ordinary_mode`."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Write ``path`` all-or-nothing: a temp file beside it, fsync, rename; removed on any error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        ordinary_mode(tmp)  # mkstemp makes 0600: give the file the mode open() would
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write the string ``text`` to ``path`` all-or-nothing (UTF-8)."""
    with atomic_write(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented, key-sorted JSON, all-or-nothing."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames in ``directory`` durable; not possible on every platform (Windows), harmless to skip."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s contents to disk (a file written by another library, e.g. safetensors)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def umask() -> int:
    """The process's umask, read without changing it where the platform allows (Linux >= 4.7:
    ``/proc/self/status``); else set and restored at once (``os.umask`` can only be read so)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ordinary_mode(path: str | os.PathLike) -> None:
    """Give ``path`` (a file or a folder made private by ``tempfile`` or a library writing through
    it) the mode ``open()`` / ``mkdir()`` would have given it: ``0o666 & ~umask`` for a file,
    ``0o777 & ~umask`` for a folder."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~umask())


def temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """``tempfile.mkdtemp(prefix=prefix, dir=parent)`` with the mode of an ordinary folder (not
    0700), for a folder that is filled, then renamed into place."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    ordinary_mode(tmp)
    return tmp
