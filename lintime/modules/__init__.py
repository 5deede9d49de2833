"""Fused building blocks: the pieces around the attention ops (:mod:`lintime.ops`) that a layer runs on every
token, each one fused pass each way on CUDA.

* ``norm``: :func:`normalize` (LayerNorm, RMSNorm, ScaleNorm over the last dimension), :func:`add_normalize`
  (the residual add and the norm in one call) and :func:`gated_normalize` (the norm times a gate);
* ``glu``: :func:`glu_activation` (``act(u) * v`` of a GLU feed-forward) and :func:`gated_activation`
  (``silu(u) * a``, the GAU / FLASH gate);
* ``heads``: :func:`gau_heads` (the GAU / FLASH heads prologue: silu, split, per-head scale and offset, RoPE);
* ``cross_entropy``: :func:`linear_cross_entropy` (the output projection and the cross-entropy fused, no
  ``[tokens, vocab]`` logits kept).

Each lives in its own folder with ``naive.py`` (the formula), ``chunk.py`` (PyTorch, any device) and the fused
path in ``triton/`` (its launch configuration in ``triton/launch.py``); the public function dispatches through
:func:`lintime.ops.dispatch.select` with an explicit ``backend=`` override (docs/design/conventions.md §2).

Families are imported on first use (PEP 562), so ``import lintime.modules`` stays cheap and a family's import
cost (e.g. Triton) is paid only by code that uses it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "normalize": "norm",
    "add_normalize": "norm",
    "gated_normalize": "norm",
    "glu_activation": "glu",
    "gated_activation": "glu",
    "gau_heads": "heads",
    "linear_cross_entropy": "cross_entropy",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    family = _EXPORTS.get(name)
    if family is None:
        raise AttributeError(f"module 'lintime.modules' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lintime.modules.{family}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
