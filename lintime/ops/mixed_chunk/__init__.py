"""Mixed chunk attention (docs/design/contract.md §2.3): FLASH's local quadratic + global linear attention."""

from __future__ import annotations

import numbers

import torch

from lintime.ops.dispatch import register_triton, require_triton, select
from lintime.ops.mixed_chunk.chunk import chunk_mixed_chunk_attention
from lintime.ops.mixed_chunk.decode import recurrent_decode_step_
from lintime.ops.mixed_chunk.naive import naive_mixed_chunk_attention
from lintime.ops.mixed_chunk.recurrent import recurrent_mixed_chunk_attention
from lintime.ops.mixed_chunk.state import LINEAR_NORMS, MixedChunkState, check_state
from lintime.ops.utils.launching import check_device
from lintime.ops.utils import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_same_btH,
    check_tensor,
    is_checked,
    mark_checked,
    num_seqs,
)

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
    C = _check_args(op, q_quad, k_quad, q_lin, k_lin, v, chunk_size, causal, rel_bias, scale, linear_norm,
                    initial_state, output_final_state, cu_seqlens)
    impl = select(op, backend, _IMPLS if causal else _NONCAUSAL_IMPLS, q_quad)
    o, final = impl(
        q_quad, k_quad, q_lin, k_lin, v, chunk_size=C, causal=causal, rel_bias=rel_bias,
        scale=None if scale is None else float(scale), linear_norm=linear_norm,
        initial_state=initial_state, output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens,
    )
    if final is not None:
        mark_checked(final.fill, final.count)
    return o, final


def _check_args(op, q_quad, k_quad, q_lin, k_lin, v, chunk_size, causal, rel_bias, scale, linear_norm, initial_state,
                output_final_state, cu_seqlens) -> int:
    """The checks of :func:`mixed_chunk_attention`'s arguments (the state's values once per state: a decoding loop
    pays them on its first step); returns the chunk size ``C``."""
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
    return C


def _load_triton_step():  # the fused decoding step (imported on first use, like the kernels above)
    from lintime.ops.mixed_chunk.triton.decode import triton_decode_step_

    return triton_decode_step_


_STEP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the fused step's inputs


def mixed_chunk_decode_step_(
    h: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    positions: torch.Tensor,
    state: MixedChunkState,
    *,
    rel_bias: torch.Tensor | None = None,
    scale: float | None = None,
    linear_norm: str = "tokens",
    rope_base: float = 10000.0,
    backend: str | None = None,
) -> torch.Tensor:
    """One FLASH decoding step (one token per sequence) from the layer's projection to its gated output, the
    state updated **in place** (seed Code 8, one token)::

        u, v, z = split(silu(h), [E, E, S])
        qq, kq, ql, kl = rope(z * gamma[i] + beta[i], positions), i = 0..3
        a, state = mixed_chunk_attention(qq, kq, ql, kl, v, initial_state=state)   # one token, H = 1
        return u * a

    The same numbers as :func:`lintime.modules.gau_heads` then :func:`mixed_chunk_attention` (recurrent form),
    but ``state``'s own tensors hold the next state: no new state, fixed shapes, no host read (once ``state``'s
    ``fill`` / ``count`` are checked: a decoding loop pays one read, on its first step), so a CUDA graph can
    capture it.  On CUDA three fused kernels (:mod:`lintime.ops.mixed_chunk.triton.decode`).

    Args:
        h: ``[N, 2E + S]`` the projection (before silu) of each sequence's token.
        gamma, beta: ``[nh, S]``, ``nh >= 4``: the scale + offset of ``q_quad, k_quad, q_lin, k_lin`` (rows
            0-3; rounded to ``h``'s dtype).
        positions: ``[N]`` int, the token's position in its sequence (RoPE; one group of ``S`` features).
        state: :class:`MixedChunkState` with ``H = 1``, buffers in ``h``'s dtype, written in place (the fused
            form needs contiguous tensors).
        rel_bias, scale, linear_norm: as :func:`mixed_chunk_attention` (``rel_bias [1, 2C - 1]``).
        rope_base: RoPE base.
        backend: ``None`` (``'triton'`` for CUDA tensors, else ``'recurrent'``), ``'triton'`` (also on the CPU
            under ``TRITON_INTERPRET=1``) or ``'recurrent'`` (PyTorch composites, any device).

    Returns:
        ``u * a`` ``[N, E]`` in ``h``'s dtype.
    """
    op = "mixed_chunk_decode_step_"
    N, C, _, S = _check_step_args(op, h, gamma, beta, positions, state, rel_bias, scale, linear_norm)
    values = not is_checked(state.fill, state.count)
    check_state(op, state, N, C, 1, S, state.v.shape[-1], h.device, values=values)
    if backend is None:
        backend = "triton" if "triton" in _IMPLS and h.is_cuda and h.dtype in _STEP_DTYPES else "recurrent"
    if backend == "recurrent":
        out = recurrent_decode_step_(h, gamma, beta, positions, state, rel_bias=rel_bias, scale=scale,
                                     linear_norm=linear_norm, rope_base=rope_base)
    elif backend == "triton":
        out = _fused_step(op, h, gamma, beta, positions, state, rel_bias, scale, linear_norm, rope_base)
    else:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose from ('recurrent', 'triton')")
    mark_checked(state.fill, state.count)
    return out


def _check_step_args(op, h, gamma, beta, positions, state, rel_bias, scale, linear_norm) -> tuple[int, ...]:
    """The checks of :func:`mixed_chunk_decode_step_`'s arguments that read no values; returns the state's
    ``(N, C, H, S)``."""
    if not isinstance(state, MixedChunkState):
        raise TypeError(f"{op}: state must be a MixedChunkState, got {type(state).__name__}")
    N, C, H, S = state.k_quad.shape
    E = state.v.shape[-1]
    for name, x in (("h", h), ("gamma", gamma), ("beta", beta), ("positions", positions)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != state.kv.device:
            raise ValueError(f"{op}: {name} is on {x.device}, the state on {state.kv.device}")
    if H != 1:
        raise ValueError(f"{op}: the step takes one head (FLASH's), the state has H={H}")
    if S % 2:
        raise ValueError(f"{op}: RoPE needs an even key width, got S={S}")
    if h.shape != (N, 2 * E + S):
        raise ValueError(f"{op}: h must be [N, 2E + S] = {[N, 2 * E + S]}, got {tuple(h.shape)}")
    if h.dtype not in FLOAT_DTYPES or any(getattr(state, f).dtype != h.dtype for f in ("k_quad", "k_lin", "v")):
        raise TypeError(f"{op}: h ({h.dtype}) and the state's buffers must share a floating dtype")
    if gamma.dim() != 2 or gamma.shape[0] < 4 or gamma.shape[1] != S or beta.shape != gamma.shape:
        raise ValueError(f"{op}: gamma and beta must both be [nh >= 4, S={S}], got {tuple(gamma.shape)} and "
                         f"{tuple(beta.shape)}")
    if positions.shape != (N,) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise ValueError(f"{op}: positions must be an int tensor [N] = [{N}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if rel_bias is not None and tuple(rel_bias.shape) != (1, 2 * C - 1):
        raise ValueError(f"{op}: rel_bias must be [1, 2C - 1] = [1, {2 * C - 1}], got {tuple(rel_bias.shape)}")
    if linear_norm not in LINEAR_NORMS:
        raise ValueError(f"{op}: linear_norm must be one of {LINEAR_NORMS}, got {linear_norm!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"{op}: scale must be a number or None, got {type(scale).__name__}")
    return N, C, H, S


def _fused_step(op, h, gamma, beta, positions, state, rel_bias, scale, linear_norm, rope_base) -> torch.Tensor:
    """The ``'triton'`` backend of :func:`mixed_chunk_decode_step_`: three kernels writing ``state`` in place."""
    N, C, _, S = state.k_quad.shape
    E = state.v.shape[-1]
    require_triton(op)
    check_device(op, h)
    if h.dtype not in _STEP_DTYPES or state.kv.dtype != torch.float32:
        raise TypeError(f"{op}: the fused step takes fp16 / bf16 / fp32 inputs and an fp32 kv, got {h.dtype} "
                        f"and {state.kv.dtype}")
    fields = ("kv", "count", "k_quad", "k_lin", "v", "fill")
    if not all(getattr(state, f).is_contiguous() for f in fields):
        raise ValueError(f"{op}: the fused step writes the state in place and needs contiguous tensors")
    bias = None if rel_bias is None else rel_bias.reshape(-1).contiguous()
    return _load_triton_step()(
        h.contiguous(), gamma.contiguous(), beta.contiguous(), positions, state.kv.view(N, S, E), state.count,
        state.k_quad.view(N, C, S), state.k_lin.view(N, C, S), state.v.view(N, C, E), state.fill, bias,
        1.0 / C if scale is None else float(scale), linear_norm, float(rope_base),
    )


__all__ = ["MixedChunkState", "mixed_chunk_attention", "mixed_chunk_decode_step_"]
