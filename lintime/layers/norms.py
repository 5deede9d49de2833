"""Normalisation layers over the last dimension (FLASH seed Code 5; RMSNorm for GLA / VQ).

All three compute in at least fp32 through :func:`lintime.modules.normalize` (one fused pass per
direction on CUDA; ``fused = False`` on a layer takes the op's chunked PyTorch reference form on every
device, :meth:`lintime.models.CausalLM.set_fused`).  They return the input dtype, or under autocast the autocast dtype: every
block feeds the result to an autocast GEMM, which would round it to that dtype anyway, so writing
it rounded saves a cast pass and half the bytes.  :meth:`Norm.add_forward` is a pre-norm block's
residual add and the norm in one call (:func:`lintime.modules.add_normalize`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lintime.modules import add_normalize, gated_normalize, normalize


def _out_dtype(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.dtype:
    """The autocast dtype when autocast is on for ``x``'s device (and the input, ``dtype`` or ``x.dtype``, is not
    fp64), else the input's dtype."""
    kind, dtype = x.device.type, x.dtype if dtype is None else dtype
    if dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


def _backend(fused: bool) -> str | None:
    """The op's backend: automatic (the fused kernels on CUDA), or its chunked PyTorch reference form."""
    return None if fused else "chunk"


class Norm(nn.Module):
    """What the three norms share: ``kind`` (the op's), ``eps``, and a ``params()`` of each norm's own giving the
    ``(weight, bias)`` it hands the op."""

    kind: str

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, *self.params(), kind=self.kind, eps=self.eps, out_dtype=_out_dtype(x),
                         backend=_backend(self.fused))

    def add_forward(self, x: torch.Tensor, branch: torch.Tensor,
                    branch_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + branch, self(x + branch))``: a pre-norm block's residual add and this norm, one pass per direction
        (the sum in ``x + branch``'s dtype, the result in the dtype :meth:`forward` gives for it).  ``branch_bias``
        ``[D]``: the branch's bias, left out of it by its mixer (:meth:`lintime.layers.Mixer.deferrable_bias`) and
        added here, ``x + (branch + branch_bias)`` (the rule of :func:`lintime.modules.add_normalize`)."""
        out_dtype = _out_dtype(x, torch.promote_types(x.dtype, branch.dtype))
        return add_normalize(x, branch, *self.params(), branch_bias=branch_bias, kind=self.kind, eps=self.eps,
                             out_dtype=out_dtype, backend=_backend(self.fused))

    def gated_forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``self(x) * silu(gate)`` (``gate`` of ``x``'s shape) in one pass per direction, rounded once to the dtype
        :meth:`forward` gives (:func:`lintime.modules.gated_normalize`)."""
        return gated_normalize(x, gate, *self.params(), kind=self.kind, eps=self.eps, out_dtype=_out_dtype(x),
                               backend=_backend(self.fused))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class LayerNorm(Norm):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` (seed Code 5, ``layer_norm``)."""

    kind = "layernorm"

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def params(self):
        return self.weight, self.bias


class ScaleNorm(Norm):
    """``g * x / sqrt(mean(x^2) + eps)`` with one learned scalar ``g`` initialised to 1
    (seed Code 5, ``scale_norm``; the seed normalises by the *mean* square, so ``g = 1``
    rather than Nguyen & Salazar's ``sqrt(d)``)."""

    kind = "scalenorm"

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)
        self.scale = nn.Parameter(torch.ones(()))

    def params(self):
        return self.scale, None


class RMSNorm(Norm):
    """``weight * x / sqrt(mean(x^2) + eps)`` with a per-feature gain (Zhang & Sennrich)."""

    kind = "rmsnorm"

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def params(self):
        return self.weight, None


NORMS = {"layernorm": LayerNorm, "scalenorm": ScaleNorm, "rmsnorm": RMSNorm}


def build_norm(kind: str, dim: int, eps: float = 1e-5) -> Norm:
    """Norm by name: ``layernorm`` | ``scalenorm`` | ``rmsnorm``."""
    try:
        cls = NORMS[kind]
    except KeyError:
        raise ValueError(f"unknown norm {kind!r}; choose from {sorted(NORMS)}") from None
    return cls(dim, eps)
