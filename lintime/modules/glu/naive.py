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


def naive_gated(u: torch.Tensor, v: torch.Tensor, *, activation: str = "silu",
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = act(u + bias) * v`` for ``u, v`` of one shape (``bias [e]`` or ``None``), in fp32 (fp64 if ``u`` or
    ``v`` is), rounded once to the promoted dtype of ``u`` and ``v``.  ``bias`` is rounded to ``u``'s dtype first
    (what a projection's output would hold); its gradient, the row sums of the pre-activation's, is summed in the
    compute precision and rounded once to ``bias``'s dtype (the rounding passes it through)."""
    out = torch.promote_types(u.dtype, v.dtype)
    acc = acc_dtype(u.new_empty(0, dtype=out))
    x = u.to(acc)
    if bias is not None:
        b = bias.to(acc)
        x = x + (b + (bias.to(u.dtype).to(acc) - b).detach())  # the value rounded to u's dtype, the gradient not
    return (_act(x, activation) * v.to(acc)).to(out)
