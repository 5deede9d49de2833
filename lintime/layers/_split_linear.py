"""One dense layer whose output is consumed as two separate tensors: ``x W[:n]^T + b[:n]`` and ``x W[n:]^T + b[n:]``.

The GAU / FLASH layers' ``dense(x)`` (seed Code 6 / 8 ``uv``) feeds two fused ops that each read their own columns:
the gate (``silu(u) * a``, :func:`lintime.ops.gated_activation`) and the heads op (``silu`` of ``v, z`` and the
scale + offset heads, :func:`lintime.ops.gau_heads`).  Computing the two parts as two products lets each op's
backward write its gradient as its own contiguous tensor; the backward here then takes both without assembling
them: ``dx = du W[:n] + dv W[n:]`` (the second product accumulated into the first's output), ``dW`` and ``db`` the
two parts' gradients stacked.  The parameters stay one ``nn.Linear`` (one weight, one bias: the checkpoint layout
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


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, n: int):
        dt = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dt)
        w = weight.to(dt)
        b = None if bias is None else bias.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            if b is None:
                y1, y2 = x2 @ w[:n].t(), x2 @ w[n:].t()
            else:
                y1, y2 = torch.addmm(b[:n], x2, w[:n].t()), torch.addmm(b[n:], x2, w[n:].t())
        ctx.save_for_backward(x2, w)
        ctx.n, ctx.has_bias, ctx.x_shape = n, bias is not None, x.shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        lead = x.shape[:-1]
        return y1.view(*lead, n), y2.view(*lead, w.shape[0] - n)

    @staticmethod
    def backward(ctx, g1: Tensor | None, g2: Tensor | None):
        x2, w = ctx.saved_tensors
        n = ctx.n
        x_dt, w_dt, b_dt = ctx.dtypes
        m, rows = x2.shape[0], w.shape[0]
        g1 = x2.new_zeros(m, n) if g1 is None else g1.reshape(m, n).to(x2.dtype)
        g2 = x2.new_zeros(m, rows - n) if g2 is None else g2.reshape(m, rows - n).to(x2.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g1 @ w[:n]
            dx.addmm_(g2, w[n:])  # accumulated in the product's epilogue: no separate add of two [m, d] tensors
            dx = dx.view(ctx.x_shape).to(x_dt)
        if ctx.needs_input_grad[1]:
            dw = torch.cat([g1.t() @ x2, g2.t() @ x2]).to(w_dt)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = torch.cat([_bias_grad(g1), _bias_grad(g2)]).to(b_dt)
        return dx, dw, db, None


class _Dense(torch.autograd.Function):
    """``F.linear`` with the bias gradient as a GEMV (:func:`_bias_grad`); the products as autocast runs them."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None):
        dt = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dt)
        w = weight.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            y = x2 @ w.t() if bias is None else torch.addmm(bias.to(dt), x2, w.t())
        ctx.save_for_backward(x2, w)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, w = ctx.saved_tensors
        x_dt, w_dt, b_dt = ctx.dtypes
        g = g.reshape(-1, w.shape[0]).to(x2.dtype)
        dx = (g @ w).view(ctx.x_shape).to(x_dt) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x2).to(w_dt) if ctx.needs_input_grad[1] else None
        db = _bias_grad(g).to(b_dt) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def dense(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` (autocast as ``F.linear``) whose backward takes the bias gradient as a GEMV."""
    return _Dense.apply(x, weight, bias)


def split_linear(x: Tensor, weight: Tensor, bias: Tensor | None, n: int) -> tuple[Tensor, Tensor]:
    """``(x W[:n]^T + b[:n], x W[n:]^T + b[n:])`` for ``x [..., d]``, ``weight [m, d]``, ``bias [m]`` or ``None``:
    ``F.linear(x, weight, bias).split([n, m - n], -1)`` as two contiguous tensors."""
    if not 0 < n < weight.shape[0]:
        raise ValueError(f"split_linear: n must be in (0, {weight.shape[0]}), got {n}")
    y1, y2 = _SplitLinear.apply(x, weight, bias, n)
    return y1, y2


__all__ = ["dense", "split_linear"]
