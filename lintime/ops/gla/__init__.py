"""Gated linear attention (docs/design/contract.md §2.5; seed "gated-linear-attention")."""

from __future__ import annotations

import numbers

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.gla.chunk import chunk_gla
from lintime.ops.gla.naive import naive_gla
from lintime.ops.gla.recurrent import recurrent_gla
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor, num_seqs

_IMPLS = {"naive": naive_gla, "chunk": chunk_gla, "recurrent": recurrent_gla}


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.ops.gla.triton import triton_gla

    return triton_gla


register_triton(_IMPLS, _load_triton)


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention, causal (seed §4.1)::

        S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,    o_t = scale * q_t S_t

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (same dtype: fp32, fp16, bf16 or fp64).
        g: ``[B, T, H, K]`` log forget gate ``log(alpha) <= 0`` (any float dtype).  Not checked
            (that would synchronise the device); a positive ``g`` is outside the contract and
            the chunked form is only guaranteed overflow-free for ``g <= 0``.
        scale: output scale, default ``K ** -0.5``.
        chunk_size: chunk length ``C`` of the chunked form (sub-chunks of 16 inside); the
            result does not depend on it.
        initial_state: ``[N, H, K, V]`` state each sequence starts from (``N = B``, or the
            number of sequences with ``cu_seqlens``); default zeros.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); states never
            cross a boundary.
        backend: ``None`` (automatic: ``triton`` for CUDA tensors when Triton is installed,
            else ``recurrent`` for ``T == 1`` and ``chunk`` otherwise), ``"naive"``, ``"chunk"``,
            ``"recurrent"`` or ``"triton"`` (fused kernels; CPU tensors only under
            ``TRITON_INTERPRET=1``).
    Returns:
        o: ``[B, T, H, V]`` in ``q``'s dtype;
        final_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs), or ``None`` unless
            ``output_final_state``.  Feeding it back as ``initial_state`` continues the
            sequences exactly.
    """
    op = "gated_linear_attention"
    check_tensor(op, "q", q)
    check_same_btH(op, "q", q, k=k, v=v, g=g)
    B, T, H, K = q.shape
    if k.shape[-1] != K or g.shape[-1] != K:
        raise ValueError(
            f"{op}: q, k and g need the same feature size K, got {K}, {k.shape[-1]} and {g.shape[-1]}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"{op}: scale must be a real number or None, got {type(scale).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"{op}: chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"{op}: output_final_state must be a bool, got {type(output_final_state).__name__}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    check_cu_seqlens(op, cu_seqlens, B, T)
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state)
        want = (num_seqs(B, cu_seqlens), H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"{op}: initial_state must have shape [N, H, K, V] = {want} "
                f"(N = {'number of sequences in cu_seqlens' if cu_seqlens is not None else 'batch'}), "
                f"got {tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"{op}: initial_state is on {initial_state.device}, q on {q.device}")
    impl = select(op, backend, _IMPLS, q)
    return impl(
        q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


__all__ = ["gated_linear_attention"]
