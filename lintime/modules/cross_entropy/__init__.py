"""Fused linear + cross-entropy: the loss of ``x W^T + b`` against targets, in chunks of rows, never
holding the whole ``[N, V]`` logits (the largest tensor of a language model's training step)."""

from __future__ import annotations

import numbers

import torch

from lintime.modules.cross_entropy.chunk import chunk_linear_cross_entropy
from lintime.modules.cross_entropy.naive import naive_linear_cross_entropy
from lintime.ops.dispatch import register_triton, select

_IMPLS = {"naive": naive_linear_cross_entropy, "chunk": chunk_linear_cross_entropy}


def _load_triton():  # the fused per-row kernel, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.modules.cross_entropy.triton import triton_linear_cross_entropy

    return triton_linear_cross_entropy


register_triton(_IMPLS, _load_triton)

_OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(x @ weight.T + bias, target)`` without materialising the logits.

    The rows are processed ``chunk_size`` at a time; for each chunk the logits are computed in
    ``x``'s dtype, reduced to the rows' losses in fp32, and -- when a gradient is needed -- turned
    in place into their gradient, from which the chunk's ``dx`` and its share of ``dweight`` and
    ``dbias`` follow at once (see :mod:`lintime.modules.cross_entropy.chunk`).  Peak memory is one
    chunk's logits instead of ``N x V`` logits plus their fp32 copy and gradient.  The result equals
    the plain loss (``backend="naive"``): in fp32 to rounding, in half precision by the half rule
    of tests/tolerances.py (the logits are rounded to ``x``'s dtype in both).

    Args:
        x: ``[..., d]`` hidden states (fp32, fp16, bf16 or fp64); the dtype of the GEMMs and of the
            logits (cast it for autocast: custom ops are not autocast).
        weight: ``[V, d]`` output projection, any floating dtype (cast to ``x``'s for the GEMMs; its
            gradient is summed in fp32 and returned in its own dtype).
        target: ``[...]`` (``x.shape[:-1]``) integer class indices in ``[0, V)`` or ``ignore_index``.
        bias: optional ``[V]``, like ``weight``.
        ignore_index: targets with this value add no loss and no gradient (and are not counted
            by ``"mean"``).
        reduction: ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"`` (per row, shape
            ``[...]``; its backward computes the logits a second time).
        label_smoothing: ``eps`` in ``[0, 1]``: the target is ``(1 - eps) onehot + eps / V``
            (PyTorch's definition).
        chunk_size: rows per chunk; default: the largest power of two whose ``[C, V]`` logits take
            at most 256 MiB (:data:`lintime.modules.cross_entropy.chunk.CHUNK_BYTES`).
        backend: ``None`` (automatic: ``triton`` for CUDA tensors in fp16 / bf16 / fp32 when Triton
            is installed, else ``chunk``), ``"naive"`` (the plain loss on the full logits),
            ``"chunk"`` (the chunk loop in PyTorch) or ``"triton"`` (the chunk loop with a fused
            Triton per-row kernel; CPU tensors only under ``TRITON_INTERPRET=1``).
    Returns:
        the loss, fp32 (fp64 for fp64 ``x``): a scalar, or ``[...]`` for ``reduction="none"``.
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{_OP}: {name} must be a floating tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, x on {x.device}")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{_OP}: need x [..., d] and weight [V, d], got {tuple(x.shape)} and {tuple(weight.shape)}")
    V, d = weight.shape
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"{_OP}: bias must have shape [V] = ({V},), got {tuple(bias.shape)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool:
        raise TypeError(f"{_OP}: target must be an integer tensor of class indices")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{_OP}: target must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"{_OP}: target is on {target.device}, x on {x.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_OP}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{_OP}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{_OP}: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"{_OP}: chunk_size must be a positive int or None, got {chunk_size!r}")
    x2 = x.reshape(-1, d).contiguous()
    y2 = target.reshape(-1).to(torch.int64).contiguous()
    impls = _IMPLS
    if backend is None and x.dtype == torch.float64:
        impls = {name: fn for name, fn in _IMPLS.items() if name != "triton"}  # the kernel has no fp64
    impl = select(_OP, backend, impls, x2)
    loss = impl(x2, weight.contiguous(), y2, None if bias is None else bias.contiguous(),
                ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                chunk_size=None if chunk_size is None else int(chunk_size))
    return loss.view(target.shape) if reduction == "none" else loss


__all__ = ["linear_cross_entropy"]
