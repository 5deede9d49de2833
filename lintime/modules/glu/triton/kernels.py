"""Triton kernels of :func:`lintime.modules.glu_activation` and :func:`lintime.modules.gated_activation`: ``y = act(u) * v``
over ``[N, E]`` rows and its backward ``du = dy * v * act'(u)``, ``dv = dy * act(u)``, one pass each way over
``BN x BE`` tiles (grid ``(cdiv(N, BN) * cdiv(E, BE),)``, row-major).  ``u``, ``v`` and their gradients are any
row-strided ``[N, E]`` views (a GLU block's ``h = [u, v]``: both halves of one ``[N, 2E]`` tensor, row stride ``2E``;
the FLASH gate: two tensors).  Everything in fp32 registers, rounded once when stored; the backward recomputes
``act(u)`` (nothing else is saved).

With ``HAS_BIAS`` (the gate's ``act(u + b) * v``, ``b [E]`` rounded to ``u``'s dtype, then added in fp32) the
backward also sums ``du`` -- the gradient of ``u + b`` and so of ``b`` -- over rows, from the unrounded fp32 values:
a program walks ``RB`` row tiles of one column tile (grid ``(cdiv(N, BN RB) * cdiv(E, BE),)``), adds each tile's
``du`` into a ``[BN, BE]`` fp32 accumulator, sums it over rows once after the loop and stores one partial row of
``part [cdiv(N, BN RB), E]`` (the host folds those rows in a fixed order: deterministic).

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
def _bias(bias, i_e, E, DT, BE: tl.constexpr):
    """Columns ``i_e BE ..`` of ``bias`` as a ``[1, BE]`` fp32 row, rounded to ``DT`` first (0 past ``E``)."""
    o_e = i_e * BE + tl.arange(0, BE)
    return tl.load(bias + o_e, mask=o_e < E, other=0.).to(DT).to(tl.float32)[None, :]


@triton.jit
def glu_fwd_kernel(u, v, y, bias, su, sv, sy, N, E, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                   BE: tl.constexpr):
    pid = tl.program_id(0)
    o_n, o_e, m = _tile(pid, N, E, BN, BE)
    b_u = tl.load(u + o_n * su + o_e, mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_u += _bias(bias, pid % tl.cdiv(E, BE), E, u.dtype.element_ty, BE)
    b_v = tl.load(v + o_n * sv + o_e, mask=m, other=0.).to(tl.float32)
    b_a, _ = _act_and_grad(b_u, ACT)
    tl.store(y + o_n * sy + o_e, (b_a * b_v).to(y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_tile(pid, dy, u, v, du, dv, b_b, sdy, su, sv, sdu, sdv, N, E, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
              BN: tl.constexpr, BE: tl.constexpr):
    """The backward of tile ``pid`` (:func:`_tile`; ``b_b`` the bias row with ``HAS_BIAS``): stores ``du`` and
    ``dv``, returns ``du`` in fp32 (0 outside the tensor: ``dy`` loads as 0 there)."""
    o_n, o_e, m = _tile(pid, N, E, BN, BE)
    b_u = tl.load(u + o_n * su + o_e, mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_u += b_b
    b_v = tl.load(v + o_n * sv + o_e, mask=m, other=0.).to(tl.float32)
    b_dy = tl.load(dy + o_n * sdy + o_e, mask=m, other=0.).to(tl.float32)
    b_a, b_da = _act_and_grad(b_u, ACT)
    b_du = b_dy * b_v * b_da
    tl.store(du + o_n * sdu + o_e, b_du.to(du.dtype.element_ty), mask=m)
    tl.store(dv + o_n * sdv + o_e, (b_dy * b_a).to(dv.dtype.element_ty), mask=m)
    return b_du


@triton.jit
def glu_bwd_kernel(dy, u, v, du, dv, bias, part, sdy, su, sv, sdu, sdv, N, E, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, RB: tl.constexpr):
    """``du``, ``dv`` and, with ``HAS_BIAS``, row ``i_p`` of ``part``: the sum of ``du`` over this program's ``RB BN``
    rows (``bias`` and ``part`` are not read without it; ``RB`` is then unused, one tile a program)."""
    pid = tl.program_id(0)
    if HAS_BIAS:
        NE = tl.cdiv(E, BE)
        i_p, i_e = pid // NE, pid % NE
        b_b = _bias(bias, i_e, E, u.dtype.element_ty, BE)
        # du summed over rows once, after the loop: the loop stays elementwise (a tl.sum per tile is slow)
        b_acc = tl.zeros([BN, BE], dtype=tl.float32)
        for i_b in range(RB):
            b_acc += _bwd_tile((i_p * RB + i_b) * NE + i_e, dy, u, v, du, dv, b_b, sdy, su, sv, sdu, sdv, N, E, ACT,
                               HAS_BIAS, BN, BE)
        o_e = i_e * BE + tl.arange(0, BE)
        tl.store(part + i_p.to(tl.int64) * E + o_e, tl.sum(b_acc, 0), mask=o_e < E)
    else:
        _bwd_tile(pid, dy, u, v, du, dv, 0., sdy, su, sv, sdu, sdv, N, E, ACT, HAS_BIAS, BN, BE)
