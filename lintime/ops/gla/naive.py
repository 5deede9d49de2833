"""Textbook gated linear attention: the seed's recurrent form (§4.1), one token at a time, one
sequence at a time, in fp32 (fp64 for fp64 inputs)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        # G_t = alpha_t^T 1, g_t = log(alpha_t)
    o_t = scale * q_t S_t

``S_0`` is the sequence's initial state (zero by default).  No chunking, no log-space tricks:
this is the reference every other form is checked against, gradients included (autograd
through the loop).
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans


def naive_gla(
    q, k, v, g, *, scale=None, chunk_size=None, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.gated_linear_attention` (``chunk_size``
    is accepted for a common signature and unused)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = acc_dtype(q)
    rows = [[] for _ in range(B)]  # per row, the outputs of its sequences in order
    finals = []
    for n, (row, s, e) in enumerate(row_spans(B, T, cu_seqlens)):
        qs, ks, vs, gs = (x[row, s:e].to(dt) for x in (q, k, v, g))  # [L, H, K] / [L, H, V]
        S = q.new_zeros(H, K, V, dtype=dt) if initial_state is None else initial_state[n].to(dt)
        for qt, kt, vt, gt in zip(qs, ks, vs, gs):
            S = gt.exp()[..., None] * S + kt[..., None] * vt[:, None, :]  # seed §4.1 recurrence
            rows[row].append(scale * torch.einsum("hk,hkv->hv", qt, S))
        finals.append(S)
    if T == 0:
        o = q.new_zeros(B, 0, H, V)
    else:
        o = torch.stack([torch.stack(r) for r in rows]).to(q.dtype)  # [B, T, H, V]
    state = torch.stack(finals) if output_final_state else None  # [N, H, K, V]
    return o, state
