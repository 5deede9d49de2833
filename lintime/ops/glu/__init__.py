"""Gated linear unit activation (FLASH seed Eq. 1-2, Shazeer 2020): ``act(u) * v`` from the fused
up-projection ``h = [u, v]`` of a GLU feed-forward block (SwiGLU: silu, GEGLU: gelu)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.glu.chunk import torch_glu
from lintime.ops.glu.naive import naive_glu

_IMPLS = {"naive": naive_glu, "chunk": torch_glu}
ACTIVATIONS = ("silu", "gelu")


def _load_triton():  # the fused kernels, picked automatically for CUDA tensors when Triton is installed
    from lintime.ops.glu.triton import triton_glu

    return triton_glu


register_triton(_IMPLS, _load_triton)


def glu_activation(h: torch.Tensor, *, activation: str = "silu", backend: str | None = None) -> torch.Tensor:
    """``act(h[..., :e]) * h[..., e:]`` for ``h [..., 2e]``: the hidden activation of a GLU block.

    Args:
        h: ``[..., 2e]`` the up-projection's output, ``u`` then ``v``; fp16 / bf16 / fp32 / fp64.
        activation: ``"silu"`` (SwiGLU) or ``"gelu"`` (GEGLU, the erf form); the value side is the identity.
        backend: ``None`` (automatic: ``"triton"`` for CUDA tensors when Triton is installed, except fp64 and
            while ``torch.compile`` traces, where inductor fuses the PyTorch form itself; else ``"chunk"``),
            ``"naive"`` (fp32 reference), ``"chunk"`` (PyTorch composite) or ``"triton"`` (one pass each way;
            CPU tensors only under ``TRITON_INTERPRET=1``).
    Returns:
        ``[..., e]`` in ``h``'s dtype; the gradient flows to ``h``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"glu: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        raise TypeError(f"glu: h must be a floating tensor, got {getattr(h, 'dtype', type(h).__name__)}")
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"glu: h's last dim must be even (u then v), got shape {tuple(h.shape)}")
    if backend is None and (h.dtype == torch.float64 or torch.compiler.is_compiling()):
        backend = "chunk"
    return select("glu_activation", backend, _IMPLS, h)(h, activation=activation)


__all__ = ["glu_activation"]
