"""Normalisation layers over the last dimension (FLASH seed Code 5; RMSNorm for GLA / VQ).

All three compute in at least fp32 through :func:`lintime.ops.normalize` (one fused pass per
direction on CUDA; ``fused = False`` on a layer takes the op's chunked PyTorch reference form on every
device, :meth:`lintime.models.CausalLM.set_fused`).  They return the input dtype, or under autocast the autocast dtype: every
block feeds the result to an autocast GEMM, which would round it to that dtype anyway, so writing
it rounded saves a cast pass and half the bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lintime.ops import normalize


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device (and ``x`` is not fp64), else ``x.dtype``."""
    kind = x.device.type
    if x.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _backend(fused: bool) -> str | None:
    """The op's backend: automatic (the fused kernels on CUDA), or its chunked PyTorch reference form."""
    return None if fused else "chunk"


class LayerNorm(nn.Module):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` (seed Code 5, ``layer_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.weight, self.bias, kind="layernorm", eps=self.eps, out_dtype=_out_dtype(x),
                         backend=_backend(self.fused))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class ScaleNorm(nn.Module):
    """``g * x / sqrt(mean(x^2) + eps)`` with one learned scalar ``g`` initialised to 1
    (seed Code 5, ``scale_norm``; the seed normalises by the *mean* square, so ``g = 1``
    rather than Nguyen & Salazar's ``sqrt(d)``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.scale = nn.Parameter(torch.ones(()))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.scale, kind="scalenorm", eps=self.eps, out_dtype=_out_dtype(x),
                         backend=_backend(self.fused))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` with a per-feature gain (Zhang & Sennrich)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.weight, kind="rmsnorm", eps=self.eps, out_dtype=_out_dtype(x),
                         backend=_backend(self.fused))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


NORMS = {"layernorm": LayerNorm, "scalenorm": ScaleNorm, "rmsnorm": RMSNorm}


def build_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """Norm by name: ``layernorm`` | ``scalenorm`` | ``rmsnorm``."""
    try:
        cls = NORMS[kind]
    except KeyError:
        raise ValueError(f"unknown norm {kind!r}; choose from {sorted(NORMS)}") from None
    return cls(dim, eps)
