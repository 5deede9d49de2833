"""Gated linear attention in its recurrent (decoding) form, token by token; ``T == 1``
dispatches here.  :func:`gla_step` is one decoding step; :func:`recurrent_gla` runs it over a
whole call, all sequences stepping together.

Packed sequences are laid out one per row (each one is a single "chunk" of the per-sequence
layout with ``C`` = the longest length), zero-padded at the end: a padding step has
``g = 0, k = 0`` so it leaves the state unchanged, and the state of a row never meets another
sequence's tokens.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, chunk_layout, num_seqs


def gla_step(q_t, k_t, v_t, g_t, state, scale: float):
    """One token: ``q_t, k_t, g_t [N, H, K]``, ``v_t [N, H, V]``, ``state [N, H, K, V]`` (fp32).

    Returns ``o_t [N, H, V]`` and the new state (seed §4.1:
    ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale * q_t S_t``)."""
    state = g_t.exp()[..., None] * state + k_t[..., None] * v_t[..., None, :]
    return scale * torch.einsum("nhk,nhkv->nhv", q_t, state), state


def recurrent_gla(
    q, k, v, g, *, scale=None, chunk_size=None, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.gated_linear_attention` (``chunk_size``
    is accepted for a common signature and unused)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = acc_dtype(q)
    N = num_seqs(B, cu_seqlens)
    h0 = q.new_zeros(N, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return q.new_zeros(B, 0, H, V), (h0 if output_final_state else None)
    if cu_seqlens is None:
        rows = [x.to(dt) for x in (q, k, v, g)]  # [B, T, H, *]: row b is sequence b
        seq = None
        layout = None
    else:
        # one row per non-empty sequence, padded to the longest one
        L = max(b - a for a, b in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]))
        layout = chunk_layout(B, T, L, cu_seqlens, q.device)
        rows = [layout.to_chunks(x.to(dt))[0] for x in (q, k, v, g)]  # [NC, L, H, *]
        seq = layout.seq[0]  # [NC] sequence of each row
    S = h0 if seq is None else h0.index_select(0, seq)
    outs = []
    # unbind once: indexing x[:, t] per step would make the backward O(T^2)
    for q_t, k_t, v_t, g_t in zip(*(x.unbind(1) for x in rows)):
        o_t, S = gla_step(q_t, k_t, v_t, g_t, S, scale)
        outs.append(o_t)
    o = torch.stack(outs, dim=1)  # [rows, L, H, V]
    if layout is not None:
        o = layout.from_chunks(o[None])
    final = None
    if output_final_state:
        final = S if seq is None else h0.index_copy(0, seq, S)  # empty sequences keep h0
    return o.to(q.dtype), final
