"""The normalisations as PyTorch composites (any device): what the layers computed before the fused
kernel, and what they compute on devices without Triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def torch_normalize(x, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.normalize` on ``x [N, D]``."""
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


def torch_add_normalize(x, r, weight, bias, *, kind, eps, out_dtype, branch_bias=None):
    """Same arguments and results as :func:`lintime.modules.norm.add_normalize` on ``x, r [N, D]``: the residual
    add of a pre-norm block (type promotion as ``x + r``) and then :func:`torch_normalize`.  With ``branch_bias``:
    ``x + (r + branch_bias rounded to r's dtype)`` in fp32 (fp64 if ``x`` or ``r`` is), rounded once; the bias's
    gradient summed in that precision (the op's rule, :func:`lintime.modules.norm.add_normalize`)."""
    if branch_bias is None:
        s = x + r
    else:
        acc = torch.float64 if torch.float64 in (x.dtype, r.dtype) else torch.float32
        c = branch_bias.to(acc)
        c = c + (branch_bias.to(r.dtype).to(acc) - c).detach()  # rounded value, unrounded gradient
        s = (x.to(acc) + (r.to(acc) + c)).to(torch.promote_types(x.dtype, r.dtype))
    return s, torch_normalize(s, weight, bias, kind=kind, eps=eps, out_dtype=out_dtype)


def torch_gated_normalize(x, z, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.gated_normalize` on ``x, z [N, D]``: the norm in
    fp32 (fp64 if either input is), times ``silu(z)`` in the same precision, rounded once to ``out_dtype``."""
    acc = torch.float64 if torch.float64 in (x.dtype, z.dtype) else torch.float32
    n = torch_normalize(x, weight, bias, kind=kind, eps=eps, out_dtype=acc)
    return (n * F.silu(z.to(acc))).to(out_dtype)
