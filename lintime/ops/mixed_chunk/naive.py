"""Textbook mixed chunk attention: for each sequence, the dense ``[T, T]`` weight matrices of the
quadratic and the linear part, written straight from the definitions (docs/design/contract.md §2.3, seed Eqs. 6-8).

A sequence continued from a state is written out explicitly: its ``f`` buffered tokens come first
(keys and values only), so query ``i`` of this call sits at position ``p_i = f + i`` of the
current chunk structure, and the state's ``kv`` adds ``q_lin_i . kv`` to the linear sum.
"""

from __future__ import annotations

import torch

from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers, normalize_linear
from lintime.ops.utils import acc_dtype, row_spans


def _one_sequence(qq, kq, ql, kl, v, kv0, count0, *, C, causal, rel_bias, scale, linear_norm):
    """One sequence: ``qq, ql [L, H, S]``; ``kq, kl [f + L, H, S]``, ``v [f + L, H, E]`` (buffered
    tokens first); ``kv0 [H, S, E]``; ``count0`` int.  Returns ``o [L, H, E]`` and the final state
    pieces."""
    L = qq.shape[0]
    M = kq.shape[0]
    f = M - L
    p = torch.arange(f, M, device=qq.device)  # [L] query positions
    j = torch.arange(M, device=qq.device)  # [M] key positions
    same_chunk = (p[:, None] // C) == (j[None, :] // C)  # [L, M]
    earlier_chunk = (j[None, :] // C) < (p[:, None] // C)  # [L, M]
    before = j[None, :] <= p[:, None]

    # quadratic part inside the chunk (seed Eq. 6): relu2(scale * q.k + b[i-j])
    s = torch.einsum("ihs,jhs->hij", qq, kq) * scale  # [H, L, M]
    if rel_bias is not None:
        idx = (p[:, None] - j[None, :] + C - 1).clamp(0, 2 * C - 2)  # only read where same_chunk
        s = s + rel_bias[:, idx]
    mask = same_chunk & before if causal else same_chunk
    w_quad = torch.where(mask, torch.relu(s) ** 2, torch.zeros((), dtype=s.dtype))
    o = torch.einsum("hij,jhe->ihe", w_quad, v)

    # linear part across chunks (seed Eqs. 7 / 8), divided by N_i
    a = torch.einsum("ihs,jhs->hij", ql, kl)  # [H, L, M]
    lin_mask = earlier_chunk if causal else torch.ones_like(earlier_chunk)
    lin = torch.einsum("hij,jhe->ihe", torch.where(lin_mask, a, torch.zeros((), dtype=a.dtype)), v)
    lin = lin + torch.einsum("ihs,hse->ihe", ql, kv0)
    n_tokens = lin_mask.sum(dim=1) + count0  # [L] tokens in each query's linear sum
    o = o + normalize_linear(lin, n_tokens[:, None, None], linear_norm, C)

    # final state: completed chunks go into kv, the rest is the new partial chunk
    done = (M // C) * C
    kv = kv0 + torch.einsum("jhs,jhe->hse", kl[:done], v[:done])
    kq, kl, v = (torch.cat([x[done:], x.new_zeros((C - (M - done), *x.shape[1:]))]) for x in (kq, kl, v))
    return o, (kv, count0 + done, kq, kl, v, M - done)


def naive_mixed_chunk_attention(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size=256, causal=True, rel_bias=None, scale=None,
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None,
):
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    C = chunk_size
    scale = 1.0 / C if scale is None else scale
    dt = acc_dtype(q_quad)
    bounds = row_spans(B, T, cu_seqlens)
    N = len(bounds)
    state = initial_state if initial_state is not None else MixedChunkState.zeros(
        N, C, H, S, E, dtype=q_quad.dtype, device=q_quad.device
    )
    bk, bl, bv = clean_buffers(state, dt)
    fills = state.fill.tolist()
    counts = state.count.tolist()
    bias = rel_bias.to(dt) if rel_bias is not None else None

    o = torch.zeros(B, T, H, E, dtype=dt, device=q_quad.device)
    finals = []
    for n, (row, s, e) in enumerate(bounds):
        # keys and values: the f buffered tokens, then this call's tokens
        kq_n, kl_n, v_n = (
            torch.cat([buf[n, : fills[n]], x[row, s:e].to(dt)]) for buf, x in ((bk, k_quad), (bl, k_lin), (bv, v))
        )
        o_n, fin = _one_sequence(
            q_quad[row, s:e].to(dt), kq_n, q_lin[row, s:e].to(dt), kl_n, v_n, state.kv[n].to(dt), counts[n],
            C=C, causal=causal, rel_bias=bias, scale=scale, linear_norm=linear_norm,
        )
        o[row, s:e] = o_n
        finals.append(fin)
    o = o.to(q_quad.dtype)
    if not output_final_state:
        return o, None
    dev = q_quad.device
    final = MixedChunkState(
        kv=torch.stack([x[0] for x in finals]),
        count=torch.tensor([x[1] for x in finals], dtype=torch.long, device=dev),
        k_quad=torch.stack([x[2] for x in finals]).to(q_quad.dtype),
        k_lin=torch.stack([x[3] for x in finals]).to(q_quad.dtype),
        v=torch.stack([x[4] for x in finals]).to(q_quad.dtype),
        fill=torch.tensor([x[5] for x in finals], dtype=torch.long, device=dev),
    )
    return o, final
