"""Attention operations, ``[B, T, H, D]`` layout (docs/design/contract.md §2): softmax, GAU, mixed chunk,
linear, gated linear and VQ attention, with the machinery they share: :mod:`lintime.ops.utils` (packing helpers, and
its modules ``launching``, ``segments``, ``state_passing``, ``tma``, ``bias``), ``dispatch`` and ``fold``.  The fused building blocks around them (norms, GLU, the heads op, the fused loss) are
:mod:`lintime.modules`.

Each family lives in its own folder with ``naive.py`` (textbook reference), ``chunk.py``
(chunked PyTorch, any device) and, where the op carries a state, ``recurrent.py``; the
public function dispatches through :func:`lintime.ops.dispatch.select`.

Families are imported on first use (PEP 562), so ``import lintime.ops`` stays cheap and a
family's import cost (e.g. Triton) is paid only by code that uses it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "softmax_attention": "softmax",
    "gau_attention": "gau",
    "mixed_chunk_attention": "mixed_chunk",
    "MixedChunkState": "mixed_chunk",
    "mixed_chunk_decode_step_": "mixed_chunk",
    "linear_attention": "linear",
    "gated_linear_attention": "gla",
    "vq_attention": "vq",
    "VQState": "vq",
    "vq_decode_step_": "vq",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    family = _EXPORTS.get(name)
    if family is None:
        raise AttributeError(f"module 'lintime.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lintime.ops.{family}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
