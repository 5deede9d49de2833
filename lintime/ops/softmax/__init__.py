"""Softmax attention (docs/design/contract.md §2.1)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import select
from lintime.ops.softmax.chunk import sdpa_softmax_attention
from lintime.ops.softmax.naive import naive_softmax_attention
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor

_IMPLS = {"naive": naive_softmax_attention, "chunk": sdpa_softmax_attention}


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Standard attention ``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` (``j <= i`` if causal).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        causal: mask future keys.
        scale: score scale, default ``K ** -0.5``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); no token attends
            across a boundary.
        backend: ``None`` (automatic), ``"naive"`` (dense masked reference) or ``"chunk"`` (SDPA).
    Returns:
        o: ``[B, T, H, V]`` in ``q``'s dtype.
    """
    op = "softmax_attention"
    check_tensor(op, "q", q)
    check_same_btH(op, "q", q, k=k, v=v)
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: q and k need the same feature size, got {q.shape[-1]} and {k.shape[-1]}")
    check_cu_seqlens(op, cu_seqlens, q.shape[0], q.shape[1])
    impl = select(op, backend, _IMPLS, q)
    return impl(q, k, v, causal=causal, scale=scale, cu_seqlens=cu_seqlens)


__all__ = ["softmax_attention"]
