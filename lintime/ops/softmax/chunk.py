"""Softmax attention through PyTorch SDPA (FlashAttention / memory-efficient / cuDNN on CUDA,
the flash CPU kernel elsewhere): never a T x T tensor on the fast paths.  Packed sequences
are attended one by one so no token sees another sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.ops.utils import seq_bounds


def sdpa_softmax_attention(q, k, v, *, causal=True, scale=None, cu_seqlens=None):
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
        )
        return o.transpose(1, 2)
    outs = []
    for _, s, e in seq_bounds(B, T, cu_seqlens):
        if e == s:
            continue
        o = F.scaled_dot_product_attention(
            q[:, s:e].transpose(1, 2), k[:, s:e].transpose(1, 2), v[:, s:e].transpose(1, 2),
            is_causal=causal, scale=scale,
        )
        outs.append(o.transpose(1, 2))
    if not outs:
        return q.new_zeros(B, T, H, v.shape[-1])
    return torch.cat(outs, dim=1)
