"""Triton kernels of :func:`lintime.modules.norm.normalize`, :func:`lintime.modules.norm.add_normalize` and
:func:`lintime.modules.norm.gated_normalize`.

Notation: ``N`` rows of ``D`` features, ``BD`` the feature block (``D`` rounded up to a power of
two: a whole row lives in registers), ``BM`` rows per tile, ``G`` programs, each walking the
``[BM, BD]`` tiles ``i_p, i_p + G, ...`` (persistent: the backward accumulates its ``dweight`` /
``dbias`` partial sums in registers and writes one ``[BD]`` row per program).  Several rows per tile
put more bytes in flight per program than one row (the kernels are bandwidth-bound: one read and
one write per element); the row tail of the last tile is masked.  ``KIND``: 0 layernorm,
1 rmsnorm / scalenorm (same row math; scalenorm's scalar gain is ``W_SCALAR``).  Statistics in fp32.

``HAS_R`` (add_normalize): the row normalised is ``s = x + r`` (``R`` the branch output added to the
residual stream ``X``), rounded to ``S``'s dtype and written there; the backward then adds the
stream's own gradient ``DS`` (``HAS_DS``) to the norm's and writes the sum to ``DX`` in the stream's
dtype and, when the branch's dtype differs (``HAS_DR``), to ``DR`` in the branch's.  ``HAS_RB``: the branch's
bias ``RB [D]`` (rounded to ``R``'s dtype) is added to ``r`` in fp32 first, ``s = x + (r + rb)``; the backward
(``HAS_DRB``) sums that same fp32 gradient over each program's rows into ``DRB [G, BD]`` (like ``DW`` / ``DB``).

``HAS_GATE`` (gated_normalize): the normalised row ``n`` leaves multiplied by ``silu(z)`` (``Z`` the gate, read
in the same pass); the backward writes ``dz = dy n silu'(z)`` to ``DZ`` and runs the norm's backward on
``dy silu(z)``, recomputing ``n`` from ``x``, the statistics, the gain and the bias ``B``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gain(W, o_d, m_d, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr):
    """The gain as an fp32 ``[1, BD]`` block: the weight, scalenorm's scalar broadcast, or ones."""
    if W_SCALAR:
        b_w = tl.load(W + o_d * 0, mask=m_d, other=0.0).to(tl.float32)
    elif HAS_W:
        b_w = tl.load(W + o_d, mask=m_d, other=0.0).to(tl.float32)
    else:
        b_w = o_d.to(tl.float32) * 0.0 + 1.0
    return b_w[None, :]


@triton.jit
def _tile(i_t, N, m_d, BM: tl.constexpr):
    """Tile ``i_t``'s rows ``o_m [BM]`` (int64: ``row * stride`` may pass 2**31), their mask ``m_m [BM]`` and the
    element mask ``m [BM, BD]`` (``m_d [BD]``: the features)."""
    o_m = i_t * BM + tl.arange(0, BM)
    m_m = o_m < N
    m = m_m[:, None] & m_d[None, :]
    return o_m.to(tl.int64), m_m, m


@triton.jit
def norm_fwd_kernel(
    X, R, RB, Z, W, B, S, Y, MEAN, RSTD,
    stride_x, stride_r, stride_z, stride_s, stride_y, N, D, eps,
    KIND: tl.constexpr, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr,
    HAS_RB: tl.constexpr, HAS_GATE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):
    i_p = tl.program_id(0)
    G = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = _gain(W, o_d, m_d, HAS_W, W_SCALAR)  # [1, BD]
    if HAS_B:
        b_b = tl.load(B + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if HAS_RB:  # the branch's bias as the branch's dtype holds it
        b_rb = tl.load(RB + o_d, mask=m_d, other=0.0).to(R.dtype.element_ty).to(tl.float32)[None, :]
    for i_t in range(i_p, tl.cdiv(N, BM), G):
        o_m, m_m, m = _tile(i_t, N, m_d, BM)
        b_x = tl.load(X + o_m[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BM, BD]
        if HAS_R:
            b_r = tl.load(R + o_m[:, None] * stride_r + o_d[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_RB:
                b_r = b_r + b_rb
            # the stream as stored (rounded to its dtype) is what the norm reads, as in `s = x + r; norm(s)`
            b_s = (b_x + b_r).to(S.dtype.element_ty)
            tl.store(S + o_m[:, None] * stride_s + o_d[None, :], b_s, mask=m)
            b_x = b_s.to(tl.float32)
        if KIND == 0:
            mean = tl.sum(b_x, 1) / D  # [BM]
            b_xc = tl.where(m_d[None, :], b_x - mean[:, None], 0.0)
            tl.store(MEAN + o_m, mean, mask=m_m)
        else:
            b_xc = b_x
        var = tl.sum(b_xc * b_xc, 1) / D
        rstd = 1.0 / tl.sqrt(var + eps)  # [BM]
        tl.store(RSTD + o_m, rstd, mask=m_m)
        b_y = b_xc * rstd[:, None] * b_w
        if HAS_B:
            b_y = b_y + b_b
        if HAS_GATE:
            b_z = tl.load(Z + o_m[:, None] * stride_z + o_d[None, :], mask=m, other=0.0).to(tl.float32)
            b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(Y + o_m[:, None] * stride_y + o_d[None, :], b_y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def norm_bwd_kernel(
    X, Z, W, B, DY, DS, DX, DR, DZ, MEAN, RSTD, DW, DB, DRB,
    stride_x, stride_z, stride_dy, stride_ds, stride_dx, stride_dr, stride_dz, N, D,
    KIND: tl.constexpr, HAS_W: tl.constexpr, W_SCALAR: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr,
    HAS_DR: tl.constexpr, HAS_DRB: tl.constexpr, HAS_GATE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):
    """``dx = rstd (g - mean(g) - xhat mean(g xhat))`` for layernorm, ``rstd (g - xhat mean(g xhat))``
    otherwise, with ``g = dy * weight`` (plus ``ds`` with ``HAS_DS``); ``DW [G, BD]`` / ``DB [G, BD]``
    get each program's sums of ``dy * xhat`` / ``dy`` over its rows, ``DRB [G, BD]`` (``HAS_DRB``) those of ``dx``
    itself in fp32 (the branch bias's gradient).  With ``HAS_GATE``, ``dy`` is first
    split into the gate's gradient and the norm's ``dy * silu(z)``.  Rows past ``N`` load ``dy = 0`` and
    add nothing to the sums."""
    i_p = tl.program_id(0)
    G = tl.num_programs(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = _gain(W, o_d, m_d, HAS_W, W_SCALAR)  # [1, BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    b_drb = tl.zeros([BD], dtype=tl.float32)
    if HAS_B:  # read by the gated backward only
        b_b = tl.load(B + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    for i_t in range(i_p, tl.cdiv(N, BM), G):
        o_m, m_m, m = _tile(i_t, N, m_d, BM)
        b_x = tl.load(X + o_m[:, None] * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BM, BD]
        b_dy = tl.load(DY + o_m[:, None] * stride_dy + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)[:, None]  # [BM, 1]
        if KIND == 0:
            mean = tl.load(MEAN + o_m, mask=m_m, other=0.0)[:, None]
            b_xhat = tl.where(m_d[None, :], (b_x - mean) * rstd, 0.0)
        else:
            b_xhat = b_x * rstd
        if HAS_GATE:
            b_z = tl.load(Z + o_m[:, None] * stride_z + o_d[None, :], mask=m, other=0.0).to(tl.float32)
            b_sig = tl.sigmoid(b_z)
            b_n = b_xhat * b_w
            if HAS_B:
                b_n = b_n + b_b
            # silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
            b_dz = b_dy * b_n * b_sig * (1.0 + b_z * (1.0 - b_sig))
            tl.store(DZ + o_m[:, None] * stride_dz + o_d[None, :], b_dz.to(DZ.dtype.element_ty), mask=m)
            b_dy = b_dy * b_z * b_sig
        b_g = b_dy * b_w
        c1 = (tl.sum(b_g * b_xhat, 1) / D)[:, None]  # [BM, 1]
        if KIND == 0:
            c2 = (tl.sum(b_g, 1) / D)[:, None]
            b_dx = (b_g - c2 - b_xhat * c1) * rstd
        else:
            b_dx = (b_g - b_xhat * c1) * rstd
        if HAS_DS:
            b_dx += tl.load(DS + o_m[:, None] * stride_ds + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DX + o_m[:, None] * stride_dx + o_d[None, :], b_dx.to(DX.dtype.element_ty), mask=m)
        if HAS_DR:
            tl.store(DR + o_m[:, None] * stride_dr + o_d[None, :], b_dx.to(DR.dtype.element_ty), mask=m)
        if HAS_W:
            b_dw += tl.sum(b_dy * b_xhat, 0)
        if HAS_B:
            b_db += tl.sum(b_dy, 0)
        if HAS_DRB:  # rows past N hold dx = 0 (dy, ds loaded as 0); columns past D are not folded
            b_drb += tl.sum(b_dx, 0)
    if HAS_W:
        tl.store(DW + i_p * BD + o_d, b_dw)
    if HAS_B:
        tl.store(DB + i_p * BD + o_d, b_db)
    if HAS_DRB:
        tl.store(DRB + i_p * BD + o_d, b_drb)
