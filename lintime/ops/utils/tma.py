"""TMA (tensor memory accelerator) loads: whether a device has them, and the host-side descriptors.

Kernels that take descriptors keep a pointer path; a launch uses the descriptors only where
:func:`tma_device` holds and :func:`tma_descriptors` could build all of them."""

from __future__ import annotations

import functools

import torch
import triton

from lintime.ops.utils.launching import interpreting

try:  # host-side TMA descriptors (Triton >= 3.4); without them the kernels take their pointer paths
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None
if tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit()) < (3, 4):  # pragma: no cover
    TensorDescriptor = None  # (3.3's descriptors are experimental, with another kernel-side API)


@functools.lru_cache(maxsize=16)
def tma_device(device: torch.device) -> bool:
    """Whether kernels on ``device`` can load through TMA tensor descriptors: NVIDIA Hopper and later
    (the interpreter emulates them), with a Triton that has host-side descriptors."""
    if TensorDescriptor is None:
        return False
    if device.type == "cuda":
        return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9
    return interpreting()


def tma_descriptors(*specs):
    """TMA descriptors of ``(tensor, rows, block)`` specs, each contiguous tensor seen as a 2-D
    ``[rows, numel / rows]`` matrix (a ``[B, T, H, D]`` input as ``[B T, H D]``: a head's tile is a
    column offset), or ``None`` when one of them is not 16-byte aligned (base or row stride) -- the
    launch then takes the kernel's pointer path."""
    out = []
    for t, rows, block in specs:
        cols = t.numel() // max(rows, 1)
        if rows == 0 or cols == 0 or t.data_ptr() % 16 or (cols * t.element_size()) % 16:
            return None
        out.append(TensorDescriptor(t, [rows, cols], [cols, 1], list(block)))
    return out
