"""Textbook linear attention in the seed's quadratic "attention mode": the masked score matrix
``scale * q k^T`` (no exponential), its row sums as the normaliser, one sequence at a time.

An initial state ``(S0, z0)`` enters as the extra terms ``scale * q S0`` (numerator) and
``scale * q . z0`` (normaliser), i.e. as if the keys/values it summarises sat before the sequence.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans


def naive_linear_attention(
    q, k, v, *, causal=True, normalize=True, scale=None, chunk_size=None,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.linear_attention` (``chunk_size`` is
    accepted for a common signature and unused)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = acc_dtype(q)
    S0, z0 = (initial_state if normalize else (initial_state, None)) if initial_state is not None else (None, None)
    o = torch.zeros(B, T, H, V, dtype=dt, device=q.device)
    finals_S, finals_z = [], []
    for n, (row, s, e) in enumerate(row_spans(B, T, cu_seqlens)):
        qs, ks, vs = q[row, s:e].to(dt), k[row, s:e].to(dt), v[row, s:e].to(dt)  # [L, H, *]
        L = e - s
        # seed "attention mode": A_ij = scale * q_i . k_j, masked to j <= i when causal
        A = torch.einsum("ihk,jhk->hij", qs, ks) * scale  # [H, L, L]
        if causal:
            A = A * torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        num = torch.einsum("hij,jhv->ihv", A, vs)  # [L, H, V]
        if S0 is not None:
            num = num + scale * torch.einsum("ihk,hkv->ihv", qs, S0[n].to(dt))
        if normalize:
            den = A.sum(-1).transpose(0, 1)  # [L, H]: row sums of the score matrix
            if z0 is not None:
                den = den + scale * torch.einsum("ihk,hk->ih", qs, z0[n].to(dt))
            num = num / den[..., None]
        if L > 0:
            o[row, s:e] = num
        if output_final_state:
            S = torch.einsum("jhk,jhv->hkv", ks, vs)  # sum_j k_j^T v_j
            z = ks.sum(0)  # sum_j k_j
            if S0 is not None:
                S = S + S0[n].to(dt)
            if z0 is not None:
                z = z + z0[n].to(dt)
            finals_S.append(S)
            finals_z.append(z)
    state = None
    if output_final_state:
        S = torch.stack(finals_S)
        state = (S, torch.stack(finals_z)) if normalize else S
    return o.to(q.dtype), state
