"""The gated linear unit activation as PyTorch composites (any device), autograd for the gradients:
operation for operation what the GLU feed-forward block computed before the op existed (``split``,
the activation, the product, each rounded in ``h``'s dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTS = {"silu": F.silu, "gelu": F.gelu}


def torch_glu(h: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """Same arguments and result as :func:`lintime.modules.glu.naive.naive_glu`."""
    u, v = h.split(h.shape[-1] // 2, dim=-1)
    return _ACTS[activation](u) * v


def torch_gated(u: torch.Tensor, v: torch.Tensor, *, activation: str = "silu",
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as :func:`lintime.modules.glu.naive.naive_gated`: what the FLASH / GAU layers computed
    before the op existed (``act(u) * v``, each step rounded in the inputs' dtype; ``u + bias.to(u.dtype)`` in
    ``u``'s dtype, as a biased projection's output was, and ``bias``'s gradient summed in it)."""
    if bias is not None:
        u = u + bias.to(u.dtype)
    return _ACTS[activation](u) * v
