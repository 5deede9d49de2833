"""Textbook GAU attention (FLASH seed Eq. 5, Code 6): the dense masked relu^2 matrix, one
sequence at a time, in fp32 (fp64 for fp64 inputs).  Gradients come from autograd."""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans


def naive_gau_attention(q, k, v, *, causal=True, rel_bias=None, scale, cu_seqlens=None):
    """``o_i = sum_j relu(scale * q_i . k_j + b[i - j]) ** 2 v_j`` over ``j <= i`` (causal) or
    all ``j`` of ``i``'s sequence; ``b[i - j] = rel_bias[h, (i - j) + T - 1]``.

    q, k: ``[B, T, H, S]``; v: ``[B, T, H, E]``; rel_bias: ``[H, 2T - 1]`` or ``None``.
    Returns ``o [B, T, H, E]`` in ``q``'s dtype.
    """
    B, T, H, _ = q.shape
    dt = acc_dtype(q)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dt, device=q.device)
    for row, s, e in row_spans(B, T, cu_seqlens):
        if e == s:
            continue
        qs, ks, vs = q[row, s:e].to(dt), k[row, s:e].to(dt), v[row, s:e].to(dt)  # [L, H, *]
        a = scale * torch.einsum("ihs,jhs->hij", qs, ks)  # [H, L, L]
        if rel_bias is not None:
            i = torch.arange(s, e, device=q.device)
            a = a + rel_bias.to(dt)[:, (i[:, None] - i[None, :]) + T - 1]  # Toeplitz b[i - j]
        a = torch.relu(a) ** 2  # seed Eq. 5
        if causal:
            a = a * torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        o[row, s:e] = torch.einsum("hij,jhe->ihe", a, vs)
    return o.to(q.dtype)
