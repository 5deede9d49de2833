"""Softmax attention (docs/design/contract.md §2.1)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import select
from lintime.ops.softmax.chunk import check_max_seqlen, sdpa_softmax_attention
from lintime.ops.softmax.naive import naive_softmax_attention
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor, is_static, static_max_seqlen

_IMPLS = {"naive": naive_softmax_attention, "chunk": sdpa_softmax_attention}


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Standard attention ``o_i = sum_j softmax_j(scale * q_i . k_j) v_j`` (``j <= i`` if causal).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        causal: mask future keys.
        scale: score scale, default ``K ** -0.5``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); no token attends
            across a boundary.  A static one (:func:`lintime.ops.utils.mark_static`: ``[Ncap + 1]`` int32 on
            the device, trailing entries repeating ``T``) is never read on the host.
        max_seqlen: with ``cu_seqlens``, a host bound on the longest sequence (the varlen kernel's grid): pass it
            where it is known without reading ``cu_seqlens`` -- the row length of a training batch whose rows are
            split into documents.  Default: the longest length read on the host; for a static ``cu_seqlens`` the
            bound given to ``mark_static``; else ``T`` where no host read is allowed (``torch.compile``): correct,
            at the cost of blocks that exit at once.
            A bound below the longest sequence is an error (a device-side assert where no host read is allowed).
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
    if max_seqlen is None and is_static(cu_seqlens):
        max_seqlen = static_max_seqlen(cu_seqlens)  # the bound the buffer's owner gave (ops.utils.mark_static)
    check_max_seqlen(op, max_seqlen, cu_seqlens, q.shape[1])
    impl = select(op, backend, _IMPLS, q)
    return impl(q, k, v, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


__all__ = ["softmax_attention"]
