"""Transformer-VQ attention (docs/design/contract.md §2.6; seed "transformer-vq": Theorem 3.7, Remark 3.9, Appendix E)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.utils import (
    check_cu_seqlens_shape,
    check_cu_seqlens_values,
    check_same_btH,
    check_tensor,
    is_checked,
    mark_checked,
    num_seqs,
)
from lintime.ops.vq.bias import dense_rel_bias, token_offsets
from lintime.ops.vq.chunk import REDUCTIONS, chunk_vq_attention
from lintime.ops.vq.decode import vq_decode_step_
from lintime.ops.vq.naive import naive_vq_attention
from lintime.ops.vq.recurrent import recurrent_vq_attention
from lintime.ops.vq.state import VQState

_IMPLS = {"naive": naive_vq_attention, "chunk": chunk_vq_attention, "recurrent": recurrent_vq_attention}


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors, T > 1)
    from lintime.ops.vq.triton import triton_vq_attention

    return triton_vq_attention


register_triton(_IMPLS, _load_triton)
_HOST_VALUES = ("chunk", "triton")  # the forms that take the call's host values (block count)
_REL_BIAS = ("chunk", "triton")  # the forms that take the window bias as a relative table


def vq_attention(
    q: torch.Tensor,
    k_hat: torch.Tensor,
    codes: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    block_len: int,
    bias: torch.Tensor | None = None,
    rel_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    reduction: str = "serial",
    initial_state: VQState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, VQState | None]:
    """Causal softmax attention over vector-quantised keys in linear time.

    ``o_i = sum_{j <= i} softmax_j(q_i . k_hat_j + b_ij) v_j`` (no extra scale), where for query
    ``i`` in block ``n = i // L`` the bias ``b_ij = bias[:, i, :, j - (n - 1) L]`` when
    ``0 <= j - (n - 1) L < 2L`` (the previous and the current block) and 0 otherwise.  Positions
    count from the sequence start and continue across calls through ``initial_state``.  Keys
    older than the window are read from the compressed cache: per code ``s``, the mean of their
    values and their count, scored ``q_i . codebook[s] + log(count_s)`` (seed Remark 3.9).

    Args:
        q: ``[B, T, H, K]``.
        k_hat: ``[B, T, H, K]`` quantised keys, ``codebook[h, codes]``.
        codes: ``[B, T, H]`` integer shortcodes in ``[0, S)``.
        v: ``[B, T, H, V]``.
        codebook: ``[H, S, K]``.
        block_len: ``L``, the block length (required).
        bias: ``[B, T, H, 2L]`` additive bias on the window, or ``None``.
        rel_bias: ``(qv [B, T, H, K], r [L + 1, H, K])``, a window bias given by a relative table (not
            with ``bias``): the key at distance ``m = i - j`` from query ``i`` gets ``qv_i . r[m]`` when
            ``0 <= m <= L``, 0 beyond (the layer's Transformer-XL term; positions as for ``bias``).  The
            blockwise forms shift the ``[T, H, L + 1]`` table into the window layout by a strided copy
            (:func:`lintime.ops.vq.bias.rel_window`) instead of the dense bias's ``[T, 2L]`` index passes.
        reduction: how per-block cache summaries are accumulated across blocks:
            ``"serial"`` (seed Code 2), ``"matmul"`` (Code 3), ``"assoc"`` (Code 4); all agree.
        initial_state: :class:`VQState` of ``N`` sequences to continue from.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); no token attends
            across a boundary, in the window or the cache.
        backend: ``None`` (automatic: ``"recurrent"`` for ``T == 1``, else ``"triton"`` for CUDA
            tensors when Triton is installed, else ``"chunk"``), ``"naive"``, ``"chunk"``,
            ``"recurrent"`` or ``"triton"`` (fused kernels; CPU tensors only under
            ``TRITON_INTERPRET=1``; fp64 or keys wider than 256 run the chunked form).

    Returns:
        o: ``[B, T, H, V]`` in ``q``'s dtype.
        final_state: :class:`VQState` (``N`` = ``B``, or the number of packed sequences) if
            ``output_final_state`` else ``None``.

    Gradients: ``q``, ``v``, ``bias``, the float fields of ``initial_state`` and the keys.  The
    chunked and recurrent forms send the gradient of a key inside a query's window to ``k_hat``
    and that of a cached key to ``codebook`` (as in the seed); the naive form sends all of it to
    ``k_hat`` (and cached initial-state keys to ``codebook``).  With ``k_hat = codebook[codes]``
    computed differentiably, the total gradient of ``codebook`` is the same in every form.
    """
    op = "vq_attention"
    S = _check_args(op, q, k_hat, codes, v, codebook, block_len, bias, rel_bias, reduction, cu_seqlens)
    B, T, H, K = q.shape
    L = block_len
    if initial_state is not None:
        _check_state(op, initial_state, num_seqs(B, cu_seqlens), H, S, K, v.shape[-1], L, q.device)
    impl = _IMPLS["recurrent"] if backend is None and T == 1 else select(op, backend, _IMPLS, q)
    extra = _host_values(op, impl, codes, S, cu_seqlens, B, T, initial_state)
    if rel_bias is not None:
        if any(impl is _IMPLS.get(name) for name in _REL_BIAS):
            extra["rel_bias"] = rel_bias
        else:  # the reference forms: the dense bias, position by position (positions on the device)
            st_pos0 = None if initial_state is None else initial_state.pos
            bias = dense_rel_bias(*rel_bias, token_offsets(B, T, L, cu_seqlens, st_pos0, q.device))
    o, final = impl(
        q, k_hat, codes, v, codebook, block_len=L, bias=bias, reduction=reduction,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, **extra,
    )
    if final is not None:
        mark_checked(final.pos)
    return o, final


def _check_args(op, q, k_hat, codes, v, codebook, block_len, bias, rel_bias, reduction, cu_seqlens) -> int:
    """The checks of :func:`vq_attention`'s arguments that read no values; returns the codebook size ``S``."""
    check_tensor(op, "q", q)
    check_same_btH(op, "q", q, k_hat=k_hat, v=v)
    B, T, H, K = q.shape
    if k_hat.shape[-1] != K:
        raise ValueError(f"{op}: q and k_hat need the same feature size, got {K} and {k_hat.shape[-1]}")
    for name, x in (("k_hat", k_hat), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{op}: {name} has dtype {x.dtype}, q has {q.dtype}")
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{op}: codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"{op}: codes must be an integer tensor, got {codes.dtype}")
    if tuple(codes.shape) != (B, T, H):
        raise ValueError(f"{op}: codes must have shape [B, T, H] = {(B, T, H)}, got {tuple(codes.shape)}")
    check_tensor(op, "codebook", codebook, ndim=3)
    if not codebook.dtype.is_floating_point:
        raise TypeError(f"{op}: codebook must be a floating tensor, got {codebook.dtype}")
    if codebook.shape[0] != H or codebook.shape[2] != K:
        raise ValueError(f"{op}: codebook must have shape [H, S, K] = [{H}, S, {K}], got {tuple(codebook.shape)}")
    S = codebook.shape[1]
    if S < 1:
        raise ValueError(f"{op}: codebook needs at least one code")
    if isinstance(block_len, bool) or not isinstance(block_len, int):
        raise TypeError(f"{op}: block_len must be an int, got {type(block_len).__name__}")
    if block_len < 1:
        raise ValueError(f"{op}: block_len must be >= 1, got {block_len}")
    L = block_len
    if bias is not None:
        check_same_btH(op, "q", q, bias=bias)
        if bias.shape[-1] != 2 * L:
            raise ValueError(f"{op}: bias must have shape [B, T, H, 2L] with 2L = {2 * L}, got {tuple(bias.shape)}")
        if bias.dtype != q.dtype:
            raise TypeError(f"{op}: bias has dtype {bias.dtype}, q has {q.dtype}")
    if rel_bias is not None:
        if bias is not None:
            raise ValueError(f"{op}: pass bias or rel_bias, not both")
        _check_rel_bias(op, rel_bias, q, L)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    if cu_seqlens is not None:  # the values are checked below, in the call's one host read
        check_cu_seqlens_shape(op, cu_seqlens, B)
    return S


def _host_values(op, impl, codes, S, cu_seqlens, B, T, initial_state) -> dict:
    """The value checks of the call and the host values its form needs (``{"host_values": ...}``, or ``{}``).  The
    checks read codes / cu_seqlens / state positions back to the host (one sync): skipped when every value was checked
    before (a state this op returned, codes the caller marked with ``lintime.ops.utils.mark_checked``) and the form
    needs no host values (the blockwise forms need them only for packed offsets and state positions)."""
    needs_host = any(impl is _IMPLS.get(name) for name in _HOST_VALUES)
    st_pos = None if initial_state is None else initial_state.pos
    if cu_seqlens is not None or (needs_host and st_pos is not None) or not is_checked(codes, st_pos):
        host = _read_values(op, codes, S, cu_seqlens, B, T, initial_state)
        mark_checked(st_pos)
    else:
        host = (None, None) if needs_host else None
    return {"host_values": host} if needs_host else {}


def _read_values(op, codes, S, cu_seqlens, B, T, st):
    """Every value check of the call in one device-to-host transfer: the codes' range, the packed
    offsets and the state's positions.  Returns ``(cu_seqlens, pos)`` as lists for the chunked
    form's block count (``None`` where absent)."""
    parts = []
    if codes.numel():
        lo, hi = torch.aminmax(codes.reshape(-1))
        parts += [lo.long()[None], hi.long()[None]]
    nz = len(parts)
    for x in (cu_seqlens, None if st is None else st.pos):
        if x is not None:
            parts.append(x.reshape(-1).long().to(codes.device))
    vals = torch.cat(parts).tolist() if parts else []
    if nz and (vals[0] < 0 or vals[1] >= S):
        raise ValueError(f"{op}: codes must lie in [0, {S}), got [{vals[0]}, {vals[1]}]")
    cu = pos = None
    if cu_seqlens is not None:
        cu = vals[nz : nz + cu_seqlens.numel()]
        check_cu_seqlens_values(op, cu, T)
    if st is not None:
        pos = vals[len(vals) - st.pos.numel():]
        if pos and min(pos) < 0:
            raise ValueError(f"{op}: initial_state.pos must be >= 0, got {pos}")
    return cu, pos


def _check_rel_bias(op, rel_bias, q, L) -> None:
    if not (isinstance(rel_bias, (tuple, list)) and len(rel_bias) == 2
            and all(isinstance(x, torch.Tensor) for x in rel_bias)):
        raise TypeError(f"{op}: rel_bias must be a pair of tensors (qv, r)")
    qv, r = rel_bias
    B, T, H, K = q.shape
    if tuple(qv.shape) != (B, T, H, K) or tuple(r.shape) != (L + 1, H, K):
        raise ValueError(f"{op}: rel_bias needs qv [B, T, H, K] = {(B, T, H, K)} and r [L + 1, H, K] = "
                         f"{(L + 1, H, K)}, got {tuple(qv.shape)} and {tuple(r.shape)}")
    if qv.dtype != q.dtype or r.dtype != q.dtype:
        raise TypeError(f"{op}: rel_bias has dtypes {qv.dtype}, {r.dtype}; q has {q.dtype}")
    if qv.device != q.device or r.device != q.device:
        raise ValueError(f"{op}: rel_bias must be on q's device {q.device}")


def _check_state(op, st, N, H, S, K, V, L, device) -> None:
    if not isinstance(st, VQState):
        raise TypeError(f"{op}: initial_state must be a VQState, got {type(st).__name__}")
    want = {
        "cache_mean": (N, H, S, V), "cache_count": (N, H, S), "k_hat": (N, 2 * L, H, K),
        "v": (N, 2 * L, H, V), "codes": (N, 2 * L, H), "pos": (N,),
    }
    for name, shape in want.items():
        x = getattr(st, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{op}: initial_state.{name} must have shape {shape}, got {got}")
        if x.device != device:
            raise ValueError(f"{op}: initial_state.{name} is on {x.device}, q on {device}")
    for name in ("cache_mean", "cache_count", "k_hat", "v"):
        if not getattr(st, name).dtype.is_floating_point:
            raise TypeError(f"{op}: initial_state.{name} must be floating, got {getattr(st, name).dtype}")
    for name in ("codes", "pos"):
        if getattr(st, name).dtype.is_floating_point:
            raise TypeError(f"{op}: initial_state.{name} must be an integer tensor")


__all__ = ["VQState", "vq_attention", "vq_decode_step_"]
