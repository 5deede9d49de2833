"""Mixed chunk attention (docs/design/contract.md §2.3): FLASH's local quadratic + global linear attention."""

from __future__ import annotations

import numbers

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.mixed_chunk.chunk import chunk_mixed_chunk_attention
from lintime.ops.mixed_chunk.naive import naive_mixed_chunk_attention
from lintime.ops.mixed_chunk.recurrent import recurrent_mixed_chunk_attention
from lintime.ops.mixed_chunk.state import LINEAR_NORMS, MixedChunkState, check_state
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor, is_checked, mark_checked, num_seqs

_IMPLS = {
    "naive": naive_mixed_chunk_attention,
    "chunk": chunk_mixed_chunk_attention,
    "recurrent": recurrent_mixed_chunk_attention,
}


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

    return triton_mixed_chunk_attention


register_triton(_IMPLS, _load_triton)

# the recurrent form cannot see future chunks
_NONCAUSAL_IMPLS = {k: f for k, f in _IMPLS.items() if k != "recurrent"}


def mixed_chunk_attention(
    q_quad: torch.Tensor,
    k_quad: torch.Tensor,
    q_lin: torch.Tensor,
    k_lin: torch.Tensor,
    v: torch.Tensor,
    *,
    chunk_size: int = 256,
    causal: bool = True,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
    linear_norm: str = "tokens",
    initial_state: MixedChunkState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, MixedChunkState | None]:
    """FLASH mixed chunk attention (seed §3.2, Eqs. 6-8, Codes 1 and 8).

    Each sequence is cut into chunks of ``C = chunk_size`` tokens, counted from its first token
    (also across calls that continue from a state).  For token ``i`` in chunk ``c(i)`` starting at
    ``s(c(i))``::

        o_i = sum_{j in c(i), j <= i if causal} relu(scale * q_quad_i . k_quad_j + b[i - j])**2 v_j
            + q_lin_i . (sum_{j < s(c(i))} k_lin_j^T v_j) / N_i           (causal)
            + q_lin_i . (sum_{all j of the sequence} k_lin_j^T v_j) / N   (non-causal)

    Args:
        q_quad, k_quad, q_lin, k_lin: ``[B, T, H, S]``; v: ``[B, T, H, E]`` (same dtype).
        chunk_size: ``C``.
        causal: mask future tokens in both parts.
        rel_bias: ``[H, 2C - 1]`` Toeplitz bias, ``b[i - j] = rel_bias[h, (i - j) + C - 1]``;
            ``None`` = no bias.
        scale: score scale of the quadratic part, default ``1 / C`` (seed Code 8's ``qk / n``).
        linear_norm: ``N`` of the linear part: ``'tokens'`` = number of tokens in the sum (seed
            Code 8's normalised segment mask; the commentary's "divide by t"; an empty sum gives 0;
            non-causal: the sequence length), ``'chunk'`` = ``C``, ``'none'`` = 1 (seed Code 1).
        initial_state: :class:`MixedChunkState` with ``N`` sequences (causal only).
        output_final_state: also return the state after the last token (causal only).
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); tokens never interact
            across a boundary and every sequence starts a fresh chunk.
        backend: ``None`` (automatic: ``triton`` for CUDA tensors when Triton is installed, else
            ``recurrent`` for ``T == 1``, else ``chunk``), ``"naive"``, ``"chunk"``, ``"recurrent"``
            (causal only) or ``"triton"`` (fused kernels; CPU tensors only under
            ``TRITON_INTERPRET=1``).
    Returns:
        o: ``[B, T, H, E]`` in the inputs' dtype (accumulated in fp32);
        state: :class:`MixedChunkState` (``N = B``, or the number of packed sequences) or ``None``.
    """
    op = "mixed_chunk_attention"
    check_tensor(op, "q_quad", q_quad)
    check_same_btH(op, "q_quad", q_quad, k_quad=k_quad, q_lin=q_lin, k_lin=k_lin, v=v)
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    for name, x in (("k_quad", k_quad), ("q_lin", q_lin), ("k_lin", k_lin)):
        if x.shape[-1] != S:
            raise ValueError(f"{op}: {name} has feature size {x.shape[-1]}, q_quad has {S}")
    for name, x in (("k_quad", k_quad), ("q_lin", q_lin), ("k_lin", k_lin), ("v", v)):
        if x.dtype != q_quad.dtype:
            raise TypeError(f"{op}: {name} is {x.dtype} but q_quad is {q_quad.dtype}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"{op}: chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")
    C = int(chunk_size)
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if linear_norm not in LINEAR_NORMS:
        raise ValueError(f"{op}: linear_norm must be one of {LINEAR_NORMS}, got {linear_norm!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"{op}: scale must be a number or None, got {type(scale).__name__}")
    if rel_bias is not None:
        check_tensor(op, "rel_bias", rel_bias, ndim=2)
        if not rel_bias.is_floating_point():
            raise TypeError(f"{op}: rel_bias must be a floating tensor, got {rel_bias.dtype}")
        if tuple(rel_bias.shape) != (H, 2 * C - 1):
            raise ValueError(
                f"{op}: rel_bias must have shape [H, 2C-1] = {(H, 2 * C - 1)}, got {tuple(rel_bias.shape)}"
            )
        if rel_bias.device != q_quad.device:
            raise ValueError(f"{op}: rel_bias is on {rel_bias.device}, inputs on {q_quad.device}")
    check_cu_seqlens(op, cu_seqlens, B, T)
    if not causal and initial_state is not None:
        raise ValueError(f"{op}: initial_state needs causal=True (a non-causal call sees the whole sequence)")
    if not causal and output_final_state:
        raise ValueError(f"{op}: output_final_state needs causal=True (there is nothing to continue)")
    if initial_state is not None:
        # the value checks (fill / count ranges) read the state back to the host: skipped for a
        # state this op returned (or already checked) and nobody modified since, so a decoding
        # loop pays them once, on its first step
        values = not (isinstance(initial_state, MixedChunkState) and is_checked(initial_state.fill, initial_state.count))
        check_state(op, initial_state, num_seqs(B, cu_seqlens), C, H, S, E, q_quad.device, values=values)
        if values:
            mark_checked(initial_state.fill, initial_state.count)

    impl = select(op, backend, _IMPLS if causal else _NONCAUSAL_IMPLS, q_quad)
    o, final = impl(
        q_quad, k_quad, q_lin, k_lin, v, chunk_size=C, causal=causal, rel_bias=rel_bias,
        scale=None if scale is None else float(scale), linear_norm=linear_norm,
        initial_state=initial_state, output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens,
    )
    if final is not None:
        mark_checked(final.fill, final.count)
    return o, final


__all__ = ["MixedChunkState", "mixed_chunk_attention"]
