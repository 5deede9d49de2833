"""The textbook normalisations over the last dimension, in fp32 (fp64 for fp64 inputs)."""

from __future__ import annotations

import torch


def naive_normalize(x, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.normalize` on ``x [N, D]``: the
    definitions written out (``mean``, ``var`` as sums over ``D``), autograd differentiates them."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    D = x.shape[-1]
    if kind == "layernorm":
        mean = xf.sum(-1, keepdim=True) / D
        var = ((xf - mean) ** 2).sum(-1, keepdim=True) / D
        y = (xf - mean) / torch.sqrt(var + eps)
    else:  # rmsnorm, scalenorm: divide by the root mean square
        y = xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) / D + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(out_dtype)


def naive_add_normalize(x, r, weight, bias, *, kind, eps, out_dtype, branch_bias=None):
    """Same arguments and results as :func:`lintime.modules.norm.add_normalize` on ``x, r [N, D]``: the sum in
    the promoted dtype of ``x`` and ``r``, then :func:`naive_normalize` of it.  With ``branch_bias [D]`` the sum is
    ``x + (r + branch_bias)`` in fp32 (fp64 if ``x`` or ``r`` is), ``branch_bias``'s value rounded to ``r``'s dtype
    first, the result rounded once; its gradient (the rows' sum of the sum's) passes the rounding in that
    precision and is rounded once to ``branch_bias``'s dtype."""
    s_dtype = torch.promote_types(x.dtype, r.dtype)
    if branch_bias is None:
        s = x.to(s_dtype) + r
    else:
        acc = torch.float64 if torch.float64 in (x.dtype, r.dtype) else torch.float32
        c = branch_bias.to(acc)
        c = c + (branch_bias.to(r.dtype).to(acc) - c).detach()  # the value rounded to r's dtype, the gradient not
        s = (x.to(acc) + (r.to(acc) + c)).to(s_dtype)
    return s, naive_normalize(s, weight, bias, kind=kind, eps=eps, out_dtype=out_dtype)


def naive_gated_normalize(x, z, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.gated_normalize` on ``x, z [N, D]``:
    :func:`naive_normalize` times ``silu(z) = z / (1 + exp(-z))``, in fp32 (fp64 if either input is)."""
    acc = torch.float64 if torch.float64 in (x.dtype, z.dtype) else torch.float32
    n = naive_normalize(x.to(acc), weight, bias, kind=kind, eps=eps, out_dtype=acc)
    zf = z.to(acc)
    return (n * (zf / (1 + torch.exp(-zf)))).to(out_dtype)
