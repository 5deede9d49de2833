"""Whether the GPU kernels a command runs were compiled here before: Triton compiles each kernel the first time a
process on a machine needs it (seconds each, a minute or more for a model's set) and keeps it in its on-disk cache, so
only a first start is slow.  A command that would be slow says so in one line beforehand, and records its success
afterwards: a marker file per (command, lintime, torch and Triton versions, GPU model) under
``$LINTIME_CACHE/kernels`` (``LINTIME_CACHE`` defaults to ``~/.cache/lintime``).  The marker says that such a run
finished here before; a cleared Triton cache makes the next start slow again without a notice."""

from __future__ import annotations

import os
import re
from pathlib import Path


def _marker(command: str, device_name: str) -> Path:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    from lintime import __version__

    key = "-".join((command, __version__, torch.__version__, triton_version, device_name))
    root = Path(os.environ.get("LINTIME_CACHE", Path.home() / ".cache" / "lintime")) / "kernels"
    return root / (re.sub(r"[^A-Za-z0-9_.+-]+", "_", key) + ".done")


def first_start_notice(command: str, device_name: str) -> str | None:
    """The line to print before ``command`` runs its kernels on ``device_name`` for the first time here, else
    ``None`` (a run of it finished here before: :func:`record_start`)."""
    if _marker(command, device_name).exists():
        return None
    return (f"lintime {command}: first run of this lintime on a {device_name} here: Triton compiles the GPU kernels "
            f"as they are first needed (a minute or more in all; later starts reuse its on-disk cache)")


def record_start(command: str, device_name: str) -> None:
    """Record that ``command`` ran its kernels to the end on ``device_name`` (best effort: a read-only cache folder
    only means the notice shows again)."""
    path = _marker(command, device_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass
