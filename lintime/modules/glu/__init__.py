"""Gated linear unit activation (FLASH seed Eq. 1-2, Shazeer 2020): ``act(u) * v`` from the fused
up-projection ``h = [u, v]`` of a GLU feed-forward block (SwiGLU: silu, GEGLU: gelu), and the same product of two
tensors, :func:`gated_activation` (the GAU / FLASH gate ``silu(dense(x)) * attention``, seed Eq. 3)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.modules.glu.chunk import torch_gated, torch_glu
from lintime.modules.glu.naive import naive_gated, naive_glu

_IMPLS = {"naive": naive_glu, "chunk": torch_glu}
_GATED_IMPLS = {"naive": naive_gated, "chunk": torch_gated}
ACTIVATIONS = ("silu", "gelu")


def _load_triton():  # the fused kernels, picked automatically for CUDA tensors when Triton is installed
    from lintime.modules.glu.triton import triton_glu

    return triton_glu


def _load_triton_gated():
    from lintime.modules.glu.triton import triton_gated

    return triton_gated


register_triton(_IMPLS, _load_triton)
register_triton(_GATED_IMPLS, _load_triton_gated)


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


def gated_activation(u: torch.Tensor, v: torch.Tensor, *, activation: str = "silu", bias: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """``act(u + bias) * v`` for two tensors of one shape: the GAU / FLASH gate (``u`` the pre-activation of the
    gate's projection, ``v`` the attention output), one pass each way on CUDA.

    Args:
        u: ``[..., e]`` pre-activation; fp16 / bf16 / fp32 / fp64.  Row-strided views (unit last stride) are read in
            place.
        v: ``[..., e]`` of ``u``'s shape, any floating dtype.
        activation: ``"silu"`` or ``"gelu"`` (the erf form).
        bias: ``None`` or ``[e]``, any floating dtype, on ``u``'s device: the projection's bias, rounded to ``u``'s
            dtype and added before the activation (a projection run without its bias lets this op add it, and the
            bias gradient -- the pre-activation's gradient summed over rows -- comes out of the gate's backward).
        backend: as for :func:`glu_activation` (``None``: ``"triton"`` for CUDA tensors when Triton is installed,
            except fp64 and while ``torch.compile`` traces; else ``"chunk"``).
    Returns:
        ``[..., e]`` in the promoted dtype of ``u`` and ``v``; gradients flow to ``u``, ``v`` and ``bias``, each in
        its own dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_activation: activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, x in [("u", u), ("v", v)] + ([("bias", bias)] if bias is not None else []):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"gated_activation: {name} must be a floating tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
    if u.shape != v.shape:
        raise ValueError(f"gated_activation: u and v must have one shape, got {tuple(u.shape)} and {tuple(v.shape)}")
    if u.dim() < 1:
        raise ValueError("gated_activation: u and v need at least one dimension")
    if bias is not None:
        if bias.shape != u.shape[-1:]:
            raise ValueError(f"gated_activation: bias must have shape (e,) = {tuple(u.shape[-1:])}, got "
                             f"{tuple(bias.shape)}")
        if bias.device != u.device:
            raise ValueError(f"gated_activation: bias must be on u's device, got {bias.device} and {u.device}")
    if backend is None and (torch.float64 in (u.dtype, v.dtype) or torch.compiler.is_compiling()):
        backend = "chunk"
    return select("gated_activation", backend, _GATED_IMPLS, u)(u, v, activation=activation, bias=bias)


__all__ = ["gated_activation", "glu_activation"]
