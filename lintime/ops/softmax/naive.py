"""Textbook softmax attention: the masked dense score matrix, one sequence at a time."""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans


def _attend(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    # q, k: [T, H, K]  v: [T, H, V]
    s = torch.einsum("ihk,jhk->hij", q, k) * scale  # [H, T, T]
    if causal:
        T = q.shape[0]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hij,jhv->ihv", p, v)


def naive_softmax_attention(q, k, v, *, causal=True, scale=None, cu_seqlens=None, max_seqlen=None):
    # max_seqlen is a kernel's grid bound: the reference walks the sequences read on the host
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    dt = acc_dtype(q)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dt, device=q.device)
    for row, s, e in row_spans(B, T, cu_seqlens):
        if e > s:
            o[row, s:e] = _attend(q[row, s:e].to(dt), k[row, s:e].to(dt), v[row, s:e].to(dt), causal, scale)
    return o.to(q.dtype)
