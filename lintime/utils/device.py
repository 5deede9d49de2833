"""Device and precision choice for the CLI, training and benchmarks."""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU; any other name as ``torch.device``.  Asking for
    CUDA where there is none raises ``ValueError`` (one line)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here (use --device cpu)")
    return dev


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """bf16 autocast on CUDA (``auto`` / ``bf16``), none (fp32) on CPU unless ``bf16`` is asked."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16
