"""The normalisations as PyTorch composites (any device): what the layers computed before the fused
kernel, and what they compute on devices without Triton."""

from __future__ import annotations

import torch


def torch_normalize(x, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.ops.norm.normalize` on ``x [N, D]``."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if kind == "layernorm":
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(out_dtype)
