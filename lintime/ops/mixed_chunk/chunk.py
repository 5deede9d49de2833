"""Chunked mixed chunk attention in PyTorch: O(T * C) memory, every chunk at once.

Notation: ``R`` rows of the chunk layout, ``NC`` chunks per row, ``C`` chunk size, ``H`` heads,
``S`` query/key width, ``E`` value width, ``N`` sequences.

* quadratic part: one batched ``[R, NC, H, C, C]`` score tensor (seed Eq. 6, Code 1);
* linear part: per-chunk ``k_lin^T v`` ``[R, NC, H, S, E]``, passed along each sequence's chunks by
  :func:`chunk_scan` (exclusive prefix, seed Eq. 8) or summed per sequence (Eq. 7);
* a state's partial chunk is handled by prepending its buffered tokens (with dummy queries whose
  outputs are dropped) to their sequence, so every sequence of the computation starts on a chunk
  boundary and the state's ``kv`` / ``count`` are its initial linear sum.
"""

from __future__ import annotations

import torch

from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers, normalize_linear
from lintime.ops.utils import acc_dtype, chunk_layout, chunk_scan, row_spans


def _prepend_buffers(xs, bufs, fills, bounds):
    """Put each sequence's ``fills[n]`` buffered tokens in front of it, packed into ``[1, T', ...]``.

    ``xs`` ``(q_quad, k_quad, q_lin, k_lin, v)`` ``[B, T, H, *]``; ``bufs`` ``(k_quad, k_lin, v)``
    ``[N, C, H, *]``.  Returns the packed inputs, their ``cu_seqlens`` and ``keep`` ``[B * T]``,
    the packed index of every original token (in ``[B, T]`` order).
    """
    qq = xs[0]
    parts = [[] for _ in range(5)]
    cu, keep, pos = [0], [], 0
    for n, (row, s, e) in enumerate(bounds):
        f = fills[n]
        dummy = qq.new_zeros((f, *qq.shape[2:]))  # queries of buffered tokens: outputs dropped
        for i, (x, pre) in enumerate(zip(xs, (dummy, bufs[0][n, :f], dummy, bufs[1][n, :f], bufs[2][n, :f]))):
            parts[i] += [pre, x[row, s:e]]
        keep.append(torch.arange(pos + f, pos + f + e - s))
        pos += f + e - s
        cu.append(pos)
    packed = [torch.cat(p)[None] for p in parts]
    device = qq.device
    return packed, torch.tensor(cu, device=device), torch.cat(keep).to(device)


def chunk_mixed_chunk_attention(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size=256, causal=True, rel_bias=None, scale=None,
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None,
):
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    C = chunk_size
    scale = 1.0 / C if scale is None else scale
    dt = acc_dtype(q_quad)
    dev = q_quad.device
    xs = [x.to(dt) for x in (q_quad, k_quad, q_lin, k_lin, v)]
    bounds = row_spans(B, T, cu_seqlens)
    N = len(bounds)

    kv0 = count0 = None
    keep = None
    if initial_state is not None:
        kv0 = initial_state.kv.to(dt)
        count0 = initial_state.count
        fills = initial_state.fill.tolist()
        if any(fills):
            bufs = clean_buffers(initial_state, dt)
            xs, cu_seqlens, keep = _prepend_buffers(xs, bufs, fills, bounds)
    qq, kq, ql, kl, vv = xs
    Bx, Tx = qq.shape[:2]
    layout = chunk_layout(Bx, Tx, C, cu_seqlens, dev)
    qq, kq, ql, kl, vv = (layout.to_chunks(x) for x in (qq, kq, ql, kl, vv))  # [R, NC, C, H, *]
    R, NC = layout.R, layout.NC

    # quadratic part (seed Eq. 6): scores [R, NC, H, C, C]; padding slots are no tokens
    s = torch.einsum("rnihs,rnjhs->rnhij", qq, kq) * scale
    if rel_bias is not None:
        i = torch.arange(C, device=dev)
        s = s + rel_bias.to(dt)[:, i[:, None] - i[None, :] + C - 1]  # b[i-j], [H, C, C]
    mask = layout.valid[:, :, None, None, :]  # [R, NC, 1, 1, C] over keys
    if causal:
        mask = mask & torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    w = torch.where(mask, torch.relu(s) ** 2, torch.zeros((), dtype=dt, device=dev))
    o = torch.einsum("rnhij,rnjhe->rnihe", w, vv)

    # linear part across chunks
    delta = torch.einsum("rnjhs,rnjhe->rnhse", kl, vv)  # [R, NC, H, S, E], padding slots are 0
    seq = layout.seq.reshape(-1)
    if causal:
        before, final = chunk_scan(layout, delta, initial=kv0)  # seed Eq. 8: sum over earlier chunks
        n_tokens = layout.positions()[:, :, 0]  # tokens of this call's earlier chunks, [R, NC]
        if count0 is not None:
            n_tokens = n_tokens + count0.index_select(0, seq).view(R, NC)
    else:
        total = delta.new_zeros((N, H, S, E)).index_add(0, seq, delta.reshape(R * NC, H, S, E))
        before = total.index_select(0, seq).view(R, NC, H, S, E)  # seed Eq. 7: the whole sequence
        lengths = torch.tensor(layout.lengths, device=dev)
        n_tokens = lengths.index_select(0, seq).view(R, NC)
    lin = torch.einsum("rnihs,rnhse->rnihe", ql, before)
    o = o + normalize_linear(lin, n_tokens[:, :, None, None, None], linear_norm, C)

    o = layout.from_chunks(o)  # [Bx, Tx, H, E]
    if keep is not None:
        o = o.reshape(Bx * Tx, H, E).index_select(0, keep).view(B, T, H, E)
    o = o.to(q_quad.dtype)
    if not output_final_state:
        return o, None

    # final state: a partial last chunk stays in the buffers, its incoming sum is the new kv
    lengths = torch.tensor(layout.lengths, device=dev)
    fill = lengths % C
    done = lengths - fill
    partial = (fill > 0)[:, None, None, None]
    last = layout.last.clamp(min=0)
    kv = torch.where(partial, before.reshape(R * NC, H, S, E).index_select(0, last), final)

    def buffer(x):
        x = x.reshape(R * NC, C, *x.shape[3:]).index_select(0, last)
        return torch.where(partial, x, torch.zeros((), dtype=x.dtype, device=dev)).to(q_quad.dtype)

    final_state = MixedChunkState(
        kv=kv,
        count=done if count0 is None else count0 + done,
        k_quad=buffer(kq), k_lin=buffer(kl), v=buffer(vv),
        fill=fill,
    )
    return o, final_state
