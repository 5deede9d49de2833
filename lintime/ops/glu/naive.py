"""Textbook gated linear unit activation (FLASH seed Eq. 1-2, Shazeer 2020): ``act(u) * v`` from the
fused up-projection ``h = [u, v]``, in fp32 (fp64 for fp64 inputs), rounded once.  Gradients come from
autograd."""

from __future__ import annotations

import math

import torch

from lintime.ops.utils import acc_dtype


def _act(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return x * torch.sigmoid(x)
    if activation == "gelu":  # the erf form
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    raise ValueError(f"glu: unknown activation {activation!r}")


def naive_glu(h: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """``y = act(h[..., :e]) * h[..., e:]`` with ``h [..., 2e]``; ``y [..., e]`` in ``h``'s dtype."""
    e = h.shape[-1] // 2
    x = h.to(acc_dtype(h))
    return (_act(x[..., :e], activation) * x[..., e:]).to(h.dtype)


def naive_gated(u: torch.Tensor, v: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """``y = act(u) * v`` for ``u, v`` of one shape, in fp32 (fp64 if either is), rounded once to the promoted
    dtype of ``u`` and ``v``."""
    out = torch.promote_types(u.dtype, v.dtype)
    acc = acc_dtype(u.new_empty(0, dtype=out))
    return (_act(u.to(acc), activation) * v.to(acc)).to(out)
