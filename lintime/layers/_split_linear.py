"""One dense layer whose output is consumed as separate tensors: ``x W[:n]^T + b[:n]``, ``x W[n:]^T + b[n:]`` (or
more parts).

The GAU / FLASH layers' ``dense(x)`` (seed Code 6 / 8 ``uv``) feeds two fused ops that each read their own columns:
the gate (``silu(u) * a``, :func:`lintime.modules.gated_activation`) and the heads op (``silu`` of ``v, z`` and the
scale + offset heads, :func:`lintime.modules.gau_heads`).  Computing the two parts as two products lets each op's
backward write its gradient as its own contiguous tensor; the backward here then takes both without assembling
them: ``dx = du W[:n] + dv W[n:]`` (the second product accumulated into the first's output), ``dW`` and ``db`` the
two parts' gradients stacked.  The parameters stay one ``nn.Linear`` (one weight, one bias: the checkpoint layout
and the decode step's single product are unchanged).  :func:`multi_linear` does the same for several layers of one
input: the Transformer-VQ layer's ``W_Q`` and ``[W_K; W_V; W_G]`` (four contiguous outputs; the value SiLU and the op
read ``v``, the gate kernel ``g``; one ``dx``).

Under autocast the products run in the autocast dtype as ``F.linear`` would (``x``, ``W`` and ``b`` cast once; the
gradients of ``W`` / ``b`` / ``x`` returned in their own dtypes).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _bias_grad(g: Tensor) -> Tensor:
    """``g.sum(0)`` of ``g [m, n]`` as a GEMV with a ones vector (the same fp32 accumulation, one rounding): faster
    than ``sum(0)`` at the layers' shapes (``docs/design/kernels.md``, GLU activation)."""
    return torch.mv(g.t(), g.new_ones(g.shape[0]))


def _weight_grad(gs: list[Tensor], x2: Tensor, parts, shape, dtype: torch.dtype) -> Tensor:
    """``dW = [g_k^T x]`` stacked by rows, in the weight's ``dtype``.  On CUDA, half-precision products of an fp32
    weight write their fp32 results straight into the rows of one fp32 tensor (cuBLAS's fp32 output: no rounding to
    half, no concatenation or cast pass)."""
    if x2.is_cuda and dtype == torch.float32 and x2.dtype in (torch.float16, torch.bfloat16):
        dw = torch.empty(shape, dtype=torch.float32, device=x2.device)
        for g, (i, j) in zip(gs, parts):
            torch.mm(g.t(), x2, out_dtype=torch.float32, out=dw[i:j])
        return dw
    return (gs[0].t() @ x2 if len(gs) == 1 else torch.cat([g.t() @ x2 for g in gs])).to(dtype)


def _compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _products(x: Tensor, spec: tuple, params) -> tuple[tuple[Tensor, ...], Tensor, list[Tensor]]:
    """The forward of :class:`_Linear`: ``(outputs, x as [m, d] in the compute dtype, the weights in it)``."""
    dt = _compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1]).to(dt)
    ws, bs, i = [], [], 0
    for _, has_bias in spec:
        ws.append(params[i].to(dt))
        bs.append(params[i + 1].to(dt) if has_bias else None)
        i += 1 + has_bias
    ys = []
    with torch.autocast(x.device.type, enabled=False):
        for w, b, (parts, _) in zip(ws, bs, spec):
            ys += [x2 @ w[i:j].t() if b is None else torch.addmm(b[i:j], x2, w[i:j].t()) for i, j in parts]
    return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys), x2, ws


class _Linear(torch.autograd.Function):
    """``F.linear`` of one input through one or more weights, each weight's rows ``parts`` (``((0, n1), (n1, n2),
    ..)``, covering every row in order) one product and one output each; ``dx`` summed over every part in the
    products' epilogues (no separate add of ``[m, d]`` tensors), the bias gradient as a GEMV (:func:`_bias_grad`).
    ``spec``: per weight ``(parts, has_bias)``; ``params``: each weight, then its bias when it has one."""

    @staticmethod
    def forward(ctx, x: Tensor, spec: tuple, *params: Tensor):
        ys, x2, ws = _products(x, spec, params)
        ctx.save_for_backward(x2, *ws)
        ctx.spec, ctx.x_shape, ctx.x_dtype = spec, x.shape, x.dtype
        ctx.dtypes = tuple(p.dtype for p in params)
        return ys

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        x2, *ws = ctx.saved_tensors
        m = x2.shape[0]
        need = ctx.needs_input_grad  # (x, spec, *params)
        dx, out, k, pi = None, [], 0, 0
        for w, (parts, has_bias) in zip(ws, ctx.spec):
            gs = [x2.new_zeros(m, j - i) if g is None else g.reshape(m, j - i).to(x2.dtype)
                  for g, (i, j) in zip(grads[k:k + len(parts)], parts)]
            k += len(parts)
            if need[0]:
                for g, (i, j) in zip(gs, parts):
                    if dx is None:
                        dx = g @ w[i:j]
                    else:
                        dx.addmm_(g, w[i:j])  # accumulated in the product's epilogue
            out.append(_weight_grad(gs, x2, parts, w.shape, ctx.dtypes[pi]) if need[2 + pi] else None)
            pi += 1
            if has_bias:
                out.append(torch.cat([_bias_grad(g) for g in gs]).to(ctx.dtypes[pi]) if need[2 + pi] else None)
                pi += 1
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, None, *out)


def _bounds(m: int, n) -> tuple:
    """``n`` (an int: two parts ``[n, m - n]``; a sequence: the sizes) as row ranges of an ``m``-row weight."""
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
    return tuple(zip(bounds[:-1], bounds[1:]))


def _apply(x: Tensor, layers) -> tuple[Tensor, ...]:
    """``layers``: ``(weight, bias or None, parts)`` triples."""
    spec = tuple((parts, b is not None) for _, b, parts in layers)
    params = [t for w, b, _ in layers for t in ((w,) if b is None else (w, b))]
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        # nothing to differentiate: the products alone.  torch.compile inlines a Function's forward there and drops
        # its ``ctx`` when the arguments after it are as many as forward's parameters after it (*params counted as
        # one): a weight with its bias made a compiled validation forward fail (tests/layers/test_split_linear.py)
        return _products(x, spec, params)[0]
    return _Linear.apply(x, spec, *params)


def dense(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` (autocast as ``F.linear``) whose backward takes the bias gradient as a GEMV."""
    return _apply(x, [(weight, bias, ((0, weight.shape[0]),))])[0]


def split_linear(x: Tensor, weight: Tensor, bias: Tensor | None, n) -> tuple[Tensor, ...]:
    """``F.linear(x, weight, bias).split(sizes, -1)`` as contiguous tensors, one product each, for ``x [..., d]``,
    ``weight [m, d]``, ``bias [m]`` or ``None``: ``n`` an int gives ``sizes = [n, m - n]``, a sequence of positive
    ints summing to ``m`` is ``sizes`` itself."""
    return _apply(x, [(weight, bias, _bounds(weight.shape[0], n))])


def multi_linear(x: Tensor, layers) -> tuple[Tensor, ...]:
    """Several dense layers of one input, ``layers`` = ``(weight, bias or None, n)`` each (``n`` as in
    :func:`split_linear`, or ``None``: one output), their outputs in order as contiguous tensors: the backward sums
    every part's ``dx`` in the products' epilogues instead of autograd adding one ``[..., d]`` gradient per layer
    (the Transformer-VQ layer's ``W_Q`` and ``[W_K; W_V; W_G]``)."""
    return _apply(x, [(w, b, ((0, w.shape[0]),) if n is None else _bounds(w.shape[0], n)) for w, b, n in layers])


__all__ = ["dense", "multi_linear", "split_linear"]
