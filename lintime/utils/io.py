"""Atomic file writes: a temporary file beside the target, flushed, fsynced and renamed over it,
then the folder fsynced, so a reader sees the old file or the new one, never half of one.
The one helper behind the token cache (:mod:`lintime.data.cache`), the tokenizer files and the
run folders (:mod:`lintime.training.checkpoint`, :mod:`lintime.training.metrics`)."""

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
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; caches and run folders are meant to be readable
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
