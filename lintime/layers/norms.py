"""Normalisation layers over the last dimension (FLASH seed Code 5; RMSNorm for GLA / VQ).

All three compute in at least fp32 and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class LayerNorm(nn.Module):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` (seed Code 5, ``layer_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _up(x)
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight + self.bias).to(x.dtype)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _up(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.scale * y).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` with a per-feature gain (Zhang & Sennrich)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _up(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)

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
