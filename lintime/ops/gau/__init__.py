"""GAU attention (docs/design/contract.md §2.2): quadratic relu^2 attention with a Toeplitz relative bias."""

from __future__ import annotations

import math
from numbers import Real

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.gau.chunk import chunk_gau_attention
from lintime.ops.gau.naive import naive_gau_attention
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor

_IMPLS = {"naive": naive_gau_attention, "chunk": chunk_gau_attention}


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.ops.gau.triton import triton_gau_attention

    return triton_gau_attention


register_triton(_IMPLS, _load_triton)


def gau_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    rel_bias: torch.Tensor | None = None,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """GAU / FLASH-Quad attention (FLASH seed Eq. 5, Code 6), no normaliser:
    ``o_i = sum_j relu(scale * q_i . k_j + b[i - j]) ** 2 v_j`` over ``j <= i`` (causal) or all
    ``j`` of ``i``'s sequence, with ``b[i - j] = rel_bias[h, (i - j) + T - 1]``.

    Args:
        q, k: ``[B, T, H, S]`` (GAU layers use ``H = 1``); v: ``[B, T, H, E]``; same dtype
            (fp16 / bf16 / fp32 / fp64) and device.
        causal: only keys ``j <= i`` (bool).
        rel_bias: Toeplitz relative bias given by its diagonals, ``[H, 2T - 1]``, or ``None``.
            With ``cu_seqlens``, ``T`` is the packed length and ``i - j`` is taken inside each
            sequence.
        scale: required score scale, a fixed number chosen by the layer (the paper's ``1/n``, the
            commentary's ``1/(n s)``); never derived from the call's length, so a short call (a
            prefix) gives exactly the prefix of a long one.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); no token attends
            across a boundary.
        backend: ``None`` (automatic: ``"triton"`` for CUDA tensors when Triton is installed,
            else ``"chunk"``), ``"naive"`` (dense masked reference), ``"chunk"`` (tiled, O(T * C)
            memory, recomputing backward) or ``"triton"`` (fused kernels; CPU tensors only under
            ``TRITON_INTERPRET=1``).
    Returns:
        o: ``[B, T, H, E]`` in ``q``'s dtype (accumulated in fp32, fp64 for fp64 inputs).
        There is no state: decoding keeps a KV cache in the layer.
    """
    op = "gau_attention"
    check_tensor(op, "q", q)
    check_same_btH(op, "q", q, k=k, v=v)
    B, T, H, S = q.shape
    if k.shape[-1] != S:
        raise ValueError(f"{op}: q and k need the same feature size, got {S} and {k.shape[-1]}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if not isinstance(scale, Real) or isinstance(scale, bool):
        raise TypeError(f"{op}: scale must be a real number (fixed by the layer), got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")
    if rel_bias is not None:
        if not isinstance(rel_bias, torch.Tensor):
            raise TypeError(f"{op}: rel_bias must be a torch.Tensor or None, got {type(rel_bias).__name__}")
        if not rel_bias.is_floating_point():
            raise TypeError(f"{op}: rel_bias must be a floating tensor, got {rel_bias.dtype}")
        if tuple(rel_bias.shape) != (H, 2 * T - 1):
            raise ValueError(f"{op}: rel_bias must have shape [H, 2T - 1] = {[H, 2 * T - 1]}, got {list(rel_bias.shape)}")
        if rel_bias.device != q.device:
            raise ValueError(f"{op}: rel_bias is on {rel_bias.device}, q on {q.device}")
    check_cu_seqlens(op, cu_seqlens, B, T)
    impl = select(op, backend, _IMPLS, q)
    return impl(q, k, v, causal=causal, rel_bias=rel_bias, scale=scale, cu_seqlens=cu_seqlens)


__all__ = ["gau_attention"]
