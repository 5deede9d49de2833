"""Triton kernels of :func:`lintime.ops.glu_activation` and :func:`lintime.ops.gated_activation`: ``y = act(u) * v``
over ``[N, E]`` rows and its backward ``du = dy * v * act'(u)``, ``dv = dy * act(u)``, one pass each way over
``BN x BE`` tiles (grid ``(cdiv(N, BN) * cdiv(E, BE),)``, row-major).  ``u``, ``v`` and their gradients are any
row-strided ``[N, E]`` views (a GLU block's ``h = [u, v]``: both halves of one ``[N, 2E]`` tensor, row stride ``2E``;
the FLASH gate: two tensors).  Everything in fp32 registers, rounded once when stored; the backward recomputes
``act(u)`` (nothing else is saved).

Activations (``ACT``): 0 silu ``u sig(u)``, 1 gelu (erf) ``u Phi(u)``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """``act(x)`` and ``act'(x)`` in fp32 (PyTorch's silu / gelu backward formulas)."""
    if ACT == 0:
        sg = 1.0 / (1.0 + tl.exp(-x))
        return x * sg, sg * (1.0 + x * (1.0 - sg))
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        return x * cdf, cdf + x * pdf


@triton.jit
def _tile(pid, N, E, BN: tl.constexpr, BE: tl.constexpr):
    NE = tl.cdiv(E, BE)
    o_n = (pid // NE).to(tl.int64) * BN + tl.arange(0, BN)
    o_e = (pid % NE) * BE + tl.arange(0, BE)
    return o_n[:, None], o_e[None, :], (o_n < N)[:, None] & (o_e < E)[None, :]


@triton.jit
def glu_fwd_kernel(u, v, y, su, sv, sy, N, E, ACT: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr):
    o_n, o_e, m = _tile(tl.program_id(0), N, E, BN, BE)
    b_u = tl.load(u + o_n * su + o_e, mask=m, other=0.).to(tl.float32)
    b_v = tl.load(v + o_n * sv + o_e, mask=m, other=0.).to(tl.float32)
    b_a, _ = _act_and_grad(b_u, ACT)
    tl.store(y + o_n * sy + o_e, (b_a * b_v).to(y.dtype.element_ty), mask=m)


@triton.jit
def glu_bwd_kernel(dy, u, v, du, dv, sdy, su, sv, sdu, sdv, N, E, ACT: tl.constexpr, BN: tl.constexpr,
                   BE: tl.constexpr):
    o_n, o_e, m = _tile(tl.program_id(0), N, E, BN, BE)
    b_u = tl.load(u + o_n * su + o_e, mask=m, other=0.).to(tl.float32)
    b_v = tl.load(v + o_n * sv + o_e, mask=m, other=0.).to(tl.float32)
    b_dy = tl.load(dy + o_n * sdy + o_e, mask=m, other=0.).to(tl.float32)
    b_a, b_da = _act_and_grad(b_u, ACT)
    tl.store(du + o_n * sdu + o_e, (b_dy * b_v * b_da).to(du.dtype.element_ty), mask=m)
    tl.store(dv + o_n * sdv + o_e, (b_dy * b_a).to(dv.dtype.element_ty), mask=m)
