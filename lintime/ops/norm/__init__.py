"""Normalisation over the last dimension (LayerNorm, RMSNorm, ScaleNorm) in one pass per direction.

On CUDA the Triton kernels read each row once and write the normalised row directly in the dtype the
next GEMM runs in (``out_dtype``: bf16 under autocast), so a pre-norm block spends one read of the
fp32 residual stream and one bf16 write per norm instead of the composite's eight passes and a cast;
the backward is one pass too (``dx`` and the per-feature partial sums of ``dweight`` / ``dbias``).
Statistics are always fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.norm.chunk import torch_normalize
from lintime.ops.norm.naive import naive_normalize

_IMPLS = {"naive": naive_normalize, "chunk": torch_normalize}


def _load_triton():  # the fused kernels, picked automatically for CUDA tensors when Triton is installed
    from lintime.ops.norm.triton import triton_normalize

    return triton_normalize


register_triton(_IMPLS, _load_triton)

_OP = "normalize"
KINDS = ("layernorm", "rmsnorm", "scalenorm")


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "layernorm",
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Normalise ``x`` over its last dimension ``D`` (FLASH seed Code 5; RMSNorm):

    * ``layernorm``: ``(x - mean) / sqrt(var + eps) * weight + bias``;
    * ``rmsnorm``: ``x / sqrt(mean(x^2) + eps) * weight`` (``weight [D]``);
    * ``scalenorm``: the same with a scalar gain (``weight []``).

    Args:
        x: ``[..., D]`` fp32, fp16, bf16 (or fp64: the PyTorch forms only).
        weight: ``[D]`` (``[]`` for ``scalenorm``) or ``None`` (no gain).
        bias: ``[D]`` or ``None`` (``layernorm`` only).
        eps: added to the variance / mean square.
        out_dtype: the result's dtype (default ``x.dtype``); a layer under autocast asks for the
            autocast dtype, which equals rounding the fp32 result, as the next autocast GEMM would.
        backend: ``None`` (automatic: ``triton`` for CUDA tensors), ``"naive"``, ``"chunk"`` or
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``).
    Returns:
        ``[..., D]`` in ``out_dtype``; gradients flow to ``x``, ``weight`` and ``bias``.
    """
    if kind not in KINDS:
        raise ValueError(f"{_OP}: kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"{_OP}: x must be a floating tensor [..., D]")
    D = x.shape[-1]
    want_w = () if kind == "scalenorm" else (D,)
    if weight is not None and tuple(weight.shape) != want_w:
        raise ValueError(f"{_OP}: {kind} weight must have shape {want_w}, got {tuple(weight.shape)}")
    if bias is not None:
        if kind != "layernorm":
            raise ValueError(f"{_OP}: only layernorm takes a bias")
        if tuple(bias.shape) != (D,):
            raise ValueError(f"{_OP}: bias must have shape ({D},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, x on {x.device}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    impls = _IMPLS
    if backend is None and (x.dtype == torch.float64 or out_dtype == torch.float64):
        impls = {name: fn for name, fn in _IMPLS.items() if name != "triton"}  # the kernels have no fp64
    x2 = x.reshape(-1, D)
    impl = select(_OP, backend, impls, x2[None])
    y = impl(x2, weight, bias, kind=kind, eps=float(eps), out_dtype=out_dtype)
    return y.view(x.shape)


__all__ = ["normalize"]
