"""Triton kernels of :func:`lintime.ops.norm.normalize` and :func:`lintime.ops.norm.add_normalize`.

Notation: ``N`` rows of ``D`` features, ``BD`` the feature block (``D`` rounded up to a power of
two: a whole row lives in registers), ``G`` programs, each walking rows ``pid, pid + G, ...``
(persistent: the backward accumulates its ``dweight`` / ``dbias`` partial sums in registers and
writes one ``[D]`` row per program).  ``KIND``: 0 layernorm, 1 rmsnorm / scalenorm (same row math;
scalenorm's scalar gain is ``W_SCALAR``).  Statistics in fp32.

``HAS_R`` (add_normalize): the row normalised is ``s = x + r`` (``R`` the branch output added to the
residual stream ``X``), rounded to ``S``'s dtype and written there; the backward then adds the
stream's own gradient ``DS`` (``HAS_DS``) to the norm's and writes the sum to ``DX`` in the stream's
dtype and, when the branch's dtype differs (``HAS_DR``), to ``DR`` in the branch's.

``HAS_GATE`` (gated_normalize): the normalised row ``n`` leaves multiplied by ``silu(z)`` (``Z`` the gate, read
in the same pass); the backward writes ``dz = dy n silu'(z)`` to ``DZ`` and runs the norm's backward on
``dy silu(z)``, recomputing ``n`` from ``x``, the statistics, the gain and the bias ``B``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gain(W, o_d, m_d, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr):
    """The gain as an fp32 ``[BD]`` block: the weight, scalenorm's scalar broadcast, or ones."""
    if W_SCALAR:
        b_w = tl.load(W + o_d * 0, mask=m_d, other=0.0).to(tl.float32)
    elif HAS_W:
        b_w = tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_w = o_d.to(tl.float32) * 0.0 + 1.0
    return b_w


@triton.jit
def norm_fwd_kernel(
    X, R, Z, W, B, S, Y, MEAN, RSTD,
    stride_x, stride_r, stride_z, stride_s, stride_y, N, D, eps,
    KIND: tl.constexpr, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
    HAS_GATE: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = _gain(W, o_d, m_d, HAS_W, W_SCALAR)
    if HAS_B:
        b_b = tl.load(B + o_d, mask=m_d, other=0.0).to(tl.float32)
    for row in range(pid, N, G):
        b_x = tl.load(X + row * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        if HAS_R:
            b_r = tl.load(R + row * stride_r + o_d, mask=m_d, other=0.0).to(tl.float32)
            # the stream as stored (rounded to its dtype) is what the norm reads, as in `s = x + r; norm(s)`
            b_s = (b_x + b_r).to(S.dtype.element_ty)
            tl.store(S + row * stride_s + o_d, b_s, mask=m_d)
            b_x = b_s.to(tl.float32)
        if KIND == 0:
            mean = tl.sum(b_x, 0) / D
            b_xc = tl.where(m_d, b_x - mean, 0.0)
            tl.store(MEAN + row, mean)
        else:
            b_xc = b_x
        var = tl.sum(b_xc * b_xc, 0) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(RSTD + row, rstd)
        b_y = b_xc * rstd * b_w
        if HAS_B:
            b_y = b_y + b_b
        if HAS_GATE:
            b_z = tl.load(Z + row * stride_z + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(Y + row * stride_y + o_d, b_y.to(Y.dtype.element_ty), mask=m_d)


@triton.jit
def norm_bwd_kernel(
    X, Z, W, B, DY, DS, DX, DR, DZ, MEAN, RSTD, DW, DB,
    stride_x, stride_z, stride_dy, stride_ds, stride_dx, stride_dr, stride_dz, N, D,
    KIND: tl.constexpr, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_DR: tl.constexpr, HAS_GATE: tl.constexpr, BD: tl.constexpr,
):
    """``dx = rstd (g - mean(g) - xhat mean(g xhat))`` for layernorm, ``rstd (g - xhat mean(g xhat))``
    otherwise, with ``g = dy * weight`` (plus ``ds`` with ``HAS_DS``); ``DW [G, BD]`` / ``DB [G, BD]``
    get each program's sums of ``dy * xhat`` / ``dy`` over its rows.  With ``HAS_GATE``, ``dy`` is first
    split into the gate's gradient and the norm's ``dy * silu(z)``."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = _gain(W, o_d, m_d, HAS_W, W_SCALAR)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    if HAS_B:  # read by the gated backward only
        b_b = tl.load(B + o_d, mask=m_d, other=0.0).to(tl.float32)
    for row in range(pid, N, G):
        b_x = tl.load(X + row * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_dy = tl.load(DY + row * stride_dy + o_d, mask=m_d, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if KIND == 0:
            mean = tl.load(MEAN + row)
            b_xhat = tl.where(m_d, (b_x - mean) * rstd, 0.0)
        else:
            b_xhat = b_x * rstd
        if HAS_GATE:
            b_z = tl.load(Z + row * stride_z + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_sig = tl.sigmoid(b_z)
            b_n = b_xhat * b_w
            if HAS_B:
                b_n = b_n + b_b
            # silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
            b_dz = b_dy * b_n * b_sig * (1.0 + b_z * (1.0 - b_sig))
            tl.store(DZ + row * stride_dz + o_d, b_dz.to(DZ.dtype.element_ty), mask=m_d)
            b_dy = b_dy * b_z * b_sig
        b_g = b_dy * b_w
        c1 = tl.sum(b_g * b_xhat, 0) / D
        if KIND == 0:
            c2 = tl.sum(b_g, 0) / D
            b_dx = (b_g - c2 - b_xhat * c1) * rstd
        else:
            b_dx = (b_g - b_xhat * c1) * rstd
        if HAS_DS:
            b_dx += tl.load(DS + row * stride_ds + o_d, mask=m_d, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + o_d, b_dx.to(DX.dtype.element_ty), mask=m_d)
        if HAS_DR:
            tl.store(DR + row * stride_dr + o_d, b_dx.to(DR.dtype.element_ty), mask=m_d)
        if HAS_W:
            b_dw += b_dy * b_xhat
        if HAS_B:
            b_db += b_dy
    if HAS_W:
        tl.store(DW + pid * BD + o_d, b_dw)
    if HAS_B:
        tl.store(DB + pid * BD + o_d, b_db)
