"""One dense layer whose output is consumed as separate tensors: ``x W[:n]^T + b[:n]``, ``x W[n:]^T + b[n:]`` (or
more parts).

The GAU / FLASH layers' ``dense(x)`` (seed Code 6 / 8 ``uv``) feeds two fused ops that each read their own columns:
the gate (``silu(u) * a``, :func:`lintime.ops.gated_activation`) and the heads op (``silu`` of ``v, z`` and the
scale + offset heads, :func:`lintime.ops.gau_heads`).  Computing the two parts as two products lets each op's
backward write its gradient as its own contiguous tensor; the backward here then takes both without assembling
them: ``dx = du W[:n] + dv W[n:]`` (the second product accumulated into the first's output), ``dW`` and ``db`` the
two parts' gradients stacked.  The Transformer-VQ layer's ``x [W_K; W_V; W_G]`` is three parts the same way (the
value SiLU and the op read ``v``, the gate kernel ``g``: contiguous, so each pass is a vectorised one).  The parameters stay one ``nn.Linear`` (one weight, one bias: the checkpoint layout
and the decode step's single product are unchanged).

Under autocast the products run in the autocast dtype as ``F.linear`` would (``x``, ``W`` and ``b`` cast once; the
gradients of ``W`` / ``b`` / ``x`` returned in their own dtypes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _bias_grad(g: Tensor) -> Tensor:
    """``g.sum(0)`` of ``g [m, n]`` as a GEMV with a ones vector (the same fp32 accumulation, one rounding): 38 us
    against 57 us for ``sum(0)`` at [32768, 1536] bf16, 24 against 48 at [32768, 768] (H200, 2026-11-27,
    ``lab/bias_grad_ab.py``)."""
    return torch.mv(g.t(), g.new_ones(g.shape[0]))


def _compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _Linear(torch.autograd.Function):
    """``F.linear`` whose weight rows ``parts`` (``((0, n1), (n1, n2), ..)``, covering every row in order) are one
    product and one output each; the bias gradient as a GEMV (:func:`_bias_grad`)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, parts: tuple):
        dt = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dt)
        w = weight.to(dt)
        b = None if bias is None else bias.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            ys = [x2 @ w[i:j].t() if b is None else torch.addmm(b[i:j], x2, w[i:j].t()) for i, j in parts]
        ctx.save_for_backward(x2, w)
        ctx.parts, ctx.has_bias, ctx.x_shape = parts, bias is not None, x.shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return tuple(y.view(*x.shape[:-1], j - i) for y, (i, j) in zip(ys, parts))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        x2, w = ctx.saved_tensors
        x_dt, w_dt, b_dt = ctx.dtypes
        m = x2.shape[0]
        gs = [x2.new_zeros(m, j - i) if g is None else g.reshape(m, j - i).to(x2.dtype)
              for g, (i, j) in zip(grads, ctx.parts)]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = gs[0] @ w[slice(*ctx.parts[0])]
            for g, (i, j) in zip(gs[1:], ctx.parts[1:]):
                dx.addmm_(g, w[i:j])  # accumulated in the product's epilogue: no separate add of two [m, d] tensors
            dx = dx.view(ctx.x_shape).to(x_dt)
        if ctx.needs_input_grad[1]:
            dw = torch.cat([g.t() @ x2 for g in gs]).to(w_dt)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = torch.cat([_bias_grad(g) for g in gs]).to(b_dt)
        return dx, dw, db, None


def dense(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` (autocast as ``F.linear``) whose backward takes the bias gradient as a GEMV."""
    return _Linear.apply(x, weight, bias, ((0, weight.shape[0]),))[0]


def split_linear(x: Tensor, weight: Tensor, bias: Tensor | None, n) -> tuple[Tensor, ...]:
    """``F.linear(x, weight, bias).split(sizes, -1)`` as contiguous tensors, one product each, for ``x [..., d]``,
    ``weight [m, d]``, ``bias [m]`` or ``None``: ``n`` an int gives ``sizes = [n, m - n]``, a sequence of positive
    ints summing to ``m`` is ``sizes`` itself."""
    m = weight.shape[0]
    if isinstance(n, int):
        if not 0 < n < m:
            raise ValueError(f"split_linear: n must be in (0, {m}), got {n}")
        n = (n, m - n)
    sizes = [int(z) for z in n]
    if len(sizes) < 2 or any(z <= 0 for z in sizes) or sum(sizes) != m:
        raise ValueError(f"split_linear: sizes must be two or more positive ints summing to {m}, got {list(n)}")
    bounds = [0]
    for z in sizes:
        bounds.append(bounds[-1] + z)
    return _Linear.apply(x, weight, bias, tuple(zip(bounds[:-1], bounds[1:])))


__all__ = ["dense", "split_linear"]
