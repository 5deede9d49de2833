"""Triton kernels of :func:`lintime.ops.gau_heads` (forward and backward).

Notation: ``TT = B * T`` rows (tokens) of the flat ``[TT, W]`` projection ``h``, ``W = GE + S``
with ``GE = 2E`` (gating) or ``E``; ``NH`` heads of width ``S``; RoPE groups of ``D = 2 HD``
features (``S / D`` groups).  ``BT x BE`` tiles of ``u`` / ``v``; ``BTH`` rows per heads block;
``BH`` (a power of two >= ``S / 2``) half-columns of the heads tiles.  An optional bias ``[W]``
(the projection's) is added to ``h`` as it is read: ``x = h + bias``.

One 1-D grid of two kinds of programs: first ``NHB`` *heads* programs (the heavier ones, scheduled
first so that none is left for the tail), each owning the ``z`` columns of its rows and every head;
then *tile* programs, row-major over ``NU`` ``u`` tiles (``NU = NE = cdiv(E, BE)``
with gating, 0 without) and ``NE`` ``v`` tiles.  In the forward a heads program owns ``BTH`` rows
and a tile program ``BT`` (``NHB = cdiv(TT, BTH)``, ``cdiv(TT, BT)`` tile rows); in the backward
a heads program owns a row group of ``ROWS_H`` rows (``NHB = cdiv(TT, ROWS_H)``) and a tile program
one of ``ROWS`` rows, looped over ``BTH`` / ``BT`` rows at a time, so the column sums of the
parameter gradients are made in registers and written once per row group.  Every element of ``h`` is read by exactly one program, once.

The heads program works on half-columns ``j < S / 2``: ``j`` is feature ``i = j % HD`` of group
``j // HD``, whose two halves sit at ``c1 = (j // HD) D + i`` and ``c2 = c1 + HD`` -- so the
rotation pairs ``(x1, x2)`` are two ``[BTH, BH]`` tiles and one ``cos / sin`` tile serves every
head.  Everything is computed in fp32 registers and rounded once, when stored.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _silu_grad(x):
    """``d silu / dx = sig(x) (1 + x (1 - sig(x)))`` (PyTorch's silu backward), fp32."""
    sg = 1.0 / (1.0 + tl.exp(-x))
    return sg * (1.0 + x * (1.0 - sg))


@triton.jit
def _tile_cols(q, E, GATING: tl.constexpr, BE: tl.constexpr):
    """Tile program ``q`` (counted from the first tile program): its row group, whether it is a ``v``
    tile, its columns in ``h`` and in ``u`` / ``v``, and their mask."""
    NE = tl.cdiv(E, BE)
    if GATING:
        NU = NE
    else:
        NU = 0
    i_g, i_c = q // (NU + NE), q % (NU + NE)  # row-major (column-major measured no faster)
    is_v = i_c >= NU
    o_e = (i_c - is_v.to(tl.int32) * NU) * BE + tl.arange(0, BE)
    if GATING:
        c0 = is_v.to(tl.int32) * E  # v's columns follow u's
    else:
        c0 = 0
    return i_g, is_v, c0 + o_e, o_e, o_e < E


@triton.jit
def _half_cols(S: tl.constexpr, HD: tl.constexpr, BH: tl.constexpr):
    """The half-columns ``j``: the feature ``i = j % HD`` (RoPE frequency index) and the offsets ``c1, c2``
    of the two halves of its pair in ``z``, and their mask."""
    o_j = tl.arange(0, BH)
    o_i = o_j % HD
    c1 = (o_j // HD) * (2 * HD) + o_i
    return o_i, c1, c1 + HD, o_j < S // 2


@triton.jit
def _rows_rope(b_f, p_pos, o_t, m_t):
    """``cos / sin [rows, BH]`` of the angles ``p * freq[i]`` of rows ``o_t`` (fp32, as RoPE in the layers: the
    same fp32 position and inverse frequency, one rounded product)."""
    b_p = tl.load(p_pos + o_t, mask=m_t, other=0).to(tl.float32)
    b_a = b_p[:, None] * b_f[None, :]  # seed Code 3: angle = position * inv_freq
    return tl.cos(b_a), tl.sin(b_a)


@triton.jit
def gau_heads_fwd_kernel(
    h, bias, u, v, heads, gamma, beta, p_pos, freq,
    TT, E, W,
    S: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, GATING: tl.constexpr, HAS_BIAS: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr, BTH: tl.constexpr, BH: tl.constexpr,
):
    """``u, v = silu(x[:, :GE])`` split, ``heads[:, n] = rope(silu(z) gamma[n] + beta[n])`` with ``x = h + bias``
    (gamma, beta and the bias rounded to ``h``'s dtype, ScaleOffset's and autocast's rule; the sum is not rounded).
    ``u`` is unused without ``GATING``.  Heads programs own ``BTH`` rows, tile programs one ``BT x BE`` tile."""
    pid = tl.program_id(0)
    DT = heads.dtype.element_ty
    NHB = tl.cdiv(TT, BTH)
    if pid < NHB:  # z and the heads
        o_i, c1, c2, m_j = _half_cols(S, HD, BH)
        o_t = pid.to(tl.int64) * BTH + tl.arange(0, BTH)
        m_t = o_t < TT
        m_h = m_t[:, None] & m_j[None, :]
        b_cos, b_sin = _rows_rope(tl.load(freq + o_i, mask=m_j, other=0.), p_pos, o_t, m_t)
        p_z = h + o_t[:, None] * W + (W - S)
        b_z1 = tl.load(p_z + c1[None, :], mask=m_h, other=0.).to(tl.float32)
        b_z2 = tl.load(p_z + c2[None, :], mask=m_h, other=0.).to(tl.float32)
        if HAS_BIAS:
            b_z1 += tl.load(bias + (W - S) + c1, mask=m_j, other=0.).to(DT).to(tl.float32)[None, :]
            b_z2 += tl.load(bias + (W - S) + c2, mask=m_j, other=0.).to(DT).to(tl.float32)[None, :]
        b_z1 = b_z1 / (1.0 + tl.exp(-b_z1))  # silu (seed Code 6)
        b_z2 = b_z2 / (1.0 + tl.exp(-b_z2))
        for n in tl.static_range(NH):
            b_g1 = tl.load(gamma + n * S + c1, mask=m_j, other=0.).to(DT).to(tl.float32)
            b_g2 = tl.load(gamma + n * S + c2, mask=m_j, other=0.).to(DT).to(tl.float32)
            b_b1 = tl.load(beta + n * S + c1, mask=m_j, other=0.).to(DT).to(tl.float32)
            b_b2 = tl.load(beta + n * S + c2, mask=m_j, other=0.).to(DT).to(tl.float32)
            b_q1 = b_z1 * b_g1[None, :] + b_b1[None, :]  # scale + offset (seed Code 6)
            b_q2 = b_z2 * b_g2[None, :] + b_b2[None, :]
            p_o = heads + (o_t[:, None] * NH + n) * S
            tl.store(p_o + c1[None, :], (b_q1 * b_cos - b_q2 * b_sin).to(DT), mask=m_h)
            tl.store(p_o + c2[None, :], (b_q2 * b_cos + b_q1 * b_sin).to(DT), mask=m_h)
    else:  # a u or v tile: silu
        i_g, is_v, o_c, o_e, m_e = _tile_cols(pid - NHB, E, GATING, BE)
        o_t = i_g.to(tl.int64) * BT + tl.arange(0, BT)
        m = (o_t < TT)[:, None] & m_e[None, :]
        b_x = tl.load(h + o_t[:, None] * W + o_c[None, :], mask=m, other=0.).to(tl.float32)
        if HAS_BIAS:
            b_x += tl.load(bias + o_c, mask=m_e, other=0.).to(DT).to(tl.float32)[None, :]
        b_y = (b_x / (1.0 + tl.exp(-b_x))).to(DT)
        o_o = o_t[:, None] * E + o_e[None, :]
        if is_v:
            tl.store(v + o_o, b_y, mask=m)
        else:
            tl.store(u + o_o, b_y, mask=m)


@triton.jit
def gau_heads_bwd_kernel(
    h, bias, du, dv, dheads, gamma, p_pos, freq, dh, dgamma_part, dbeta_part, dbias_part, dbias_part_z,
    TT, E, W,
    S: tl.constexpr, NH: tl.constexpr, NHP: tl.constexpr, HD: tl.constexpr, GATING: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DU: tl.constexpr, HAS_DV: tl.constexpr, HAS_DHEADS: tl.constexpr,
    NEED_DP: tl.constexpr, NEED_DB: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr, BTH: tl.constexpr, BH: tl.constexpr, ROWS: tl.constexpr,
    ROWS_H: tl.constexpr,
):
    """``dh`` in one pass (absent output gradients count as zero) and, per row group (``ROWS_H`` rows for a heads
    program, ``ROWS`` for a tile program), the partial column sums of ``dgamma`` / ``dbeta`` (``NEED_DP``:
    ``[NH, S]`` fp32 at row ``pid`` of ``dgamma_part`` / ``dbeta_part``) and of ``dbias = sum_t dh`` (``NEED_DB``:
    the ``u`` / ``v`` columns in the ``[GE]`` rows of ``dbias_part``, the ``z`` columns in the ``[S]`` rows of
    ``dbias_part_z``); the caller sums them, in a fixed order.

    Every program loops over its row group, ``BTH`` (heads) or ``BT`` (tiles) rows at a time, and keeps its sums
    in registers until the end.  The heads program holds all ``NH`` heads (``NHP``, a power of two) as the middle
    axis of ``[BTH, NHP, BH]`` tiles.  The heads' backward: un-rotate (``dq1 = do1 cos + do2 sin``,
    ``dq2 = do2 cos - do1 sin``), then ``dgamma[n] += dq silu(z)``, ``dbeta[n] += dq``,
    ``d silu(z) = sum_n dq gamma[n]``."""
    pid = tl.program_id(0)
    DT = dh.dtype.element_ty
    NHB = tl.cdiv(TT, ROWS_H)
    if pid < NHB:
        o_i, c1, c2, m_j = _half_cols(S, HD, BH)
        b_f = tl.load(freq + o_i, mask=m_j, other=0.)
        o_n = tl.arange(0, NHP)
        m_nj = (o_n < NH)[:, None] & m_j[None, :]
        if HAS_DHEADS:  # [NHP, BH]
            b_g1 = tl.load(gamma + o_n[:, None] * S + c1[None, :], mask=m_nj, other=0.).to(DT).to(tl.float32)
            b_g2 = tl.load(gamma + o_n[:, None] * S + c2[None, :], mask=m_nj, other=0.).to(DT).to(tl.float32)
        if HAS_BIAS:
            b_b1 = tl.load(bias + (W - S) + c1, mask=m_j, other=0.).to(DT).to(tl.float32)
            b_b2 = tl.load(bias + (W - S) + c2, mask=m_j, other=0.).to(DT).to(tl.float32)
        b_ag1 = tl.zeros([BTH, NHP, BH], dtype=tl.float32)  # dgamma, dbeta sums (padding rows hold dq = 0)
        b_ag2 = tl.zeros([BTH, NHP, BH], dtype=tl.float32)
        b_ab1 = tl.zeros([BTH, NHP, BH], dtype=tl.float32)
        b_ab2 = tl.zeros([BTH, NHP, BH], dtype=tl.float32)
        b_az1 = tl.zeros([BTH, BH], dtype=tl.float32)  # dbias sums of the z columns
        b_az2 = tl.zeros([BTH, BH], dtype=tl.float32)
        for i_b in range(ROWS_H // BTH):
            o_t = pid.to(tl.int64) * ROWS_H + i_b * BTH + tl.arange(0, BTH)
            m_t = o_t < TT
            m_h = m_t[:, None] & m_j[None, :]
            p_z = h + o_t[:, None] * W + (W - S)
            b_z1 = tl.load(p_z + c1[None, :], mask=m_h, other=0.).to(tl.float32)
            b_z2 = tl.load(p_z + c2[None, :], mask=m_h, other=0.).to(tl.float32)
            if HAS_BIAS:
                b_z1 += b_b1[None, :]
                b_z2 += b_b2[None, :]
            b_ds1 = tl.zeros([BTH, BH], dtype=tl.float32)  # d silu(z)
            b_ds2 = tl.zeros([BTH, BH], dtype=tl.float32)
            if HAS_DHEADS:
                b_cos, b_sin = _rows_rope(b_f, p_pos, o_t, m_t)
                p_d = dheads + (o_t[:, None, None] * NH + o_n[None, :, None]) * S
                m_d = m_t[:, None, None] & m_nj[None, :, :]
                b_do1 = tl.load(p_d + c1[None, None, :], mask=m_d, other=0.).to(tl.float32)  # [BTH, NHP, BH]
                b_do2 = tl.load(p_d + c2[None, None, :], mask=m_d, other=0.).to(tl.float32)
                b_dq1 = b_do1 * b_cos[:, None, :] + b_do2 * b_sin[:, None, :]  # the transposed rotation
                b_dq2 = b_do2 * b_cos[:, None, :] - b_do1 * b_sin[:, None, :]
                b_ds1 = tl.sum(b_dq1 * b_g1[None, :, :], 1)
                b_ds2 = tl.sum(b_dq2 * b_g2[None, :, :], 1)
                if NEED_DP:
                    b_s1 = b_z1 / (1.0 + tl.exp(-b_z1))
                    b_s2 = b_z2 / (1.0 + tl.exp(-b_z2))
                    b_ag1 += b_dq1 * b_s1[:, None, :]
                    b_ag2 += b_dq2 * b_s2[:, None, :]
                    b_ab1 += b_dq1
                    b_ab2 += b_dq2
            b_dz1 = b_ds1 * _silu_grad(b_z1)
            b_dz2 = b_ds2 * _silu_grad(b_z2)
            p_dz = dh + o_t[:, None] * W + (W - S)
            tl.store(p_dz + c1[None, :], b_dz1.to(DT), mask=m_h)
            tl.store(p_dz + c2[None, :], b_dz2.to(DT), mask=m_h)
            if NEED_DB:  # padding rows hold ds = 0
                b_az1 += b_dz1
                b_az2 += b_dz2
        if NEED_DP:
            p_g = dgamma_part + (pid.to(tl.int64) * NH + o_n[:, None]) * S
            p_b = dbeta_part + (pid.to(tl.int64) * NH + o_n[:, None]) * S
            tl.store(p_g + c1[None, :], tl.sum(b_ag1, 0), mask=m_nj)
            tl.store(p_g + c2[None, :], tl.sum(b_ag2, 0), mask=m_nj)
            tl.store(p_b + c1[None, :], tl.sum(b_ab1, 0), mask=m_nj)
            tl.store(p_b + c2[None, :], tl.sum(b_ab2, 0), mask=m_nj)
        if NEED_DB:
            p_db = dbias_part_z + pid.to(tl.int64) * S
            tl.store(p_db + c1, tl.sum(b_az1, 0), mask=m_j)
            tl.store(p_db + c2, tl.sum(b_az2, 0), mask=m_j)
    else:  # the u or v columns of one tile over its row group
        i_g, is_v, o_c, o_e, m_e = _tile_cols(pid - NHB, E, GATING, BE)
        if HAS_BIAS:
            b_b = tl.load(bias + o_c, mask=m_e, other=0.).to(DT).to(tl.float32)
        b_acc = tl.zeros([BT, BE], dtype=tl.float32)  # dbias sums (padding rows hold dy = 0)
        for i_b in range(ROWS // BT):
            o_t = i_g.to(tl.int64) * ROWS + i_b * BT + tl.arange(0, BT)
            m = (o_t < TT)[:, None] & m_e[None, :]
            o_o = o_t[:, None] * E + o_e[None, :]
            b_dy = tl.zeros([BT, BE], dtype=tl.float32)
            if is_v:
                if HAS_DV:
                    b_dy = tl.load(dv + o_o, mask=m, other=0.).to(tl.float32)
            else:
                if HAS_DU:
                    b_dy = tl.load(du + o_o, mask=m, other=0.).to(tl.float32)
            o_h = o_t[:, None] * W + o_c[None, :]
            b_x = tl.load(h + o_h, mask=m, other=0.).to(tl.float32)
            if HAS_BIAS:
                b_x += b_b[None, :]
            b_dx = b_dy * _silu_grad(b_x)
            tl.store(dh + o_h, b_dx.to(DT), mask=m)
            if NEED_DB:
                b_acc += b_dx
        if NEED_DB:
            tl.store(dbias_part + i_g.to(tl.int64) * (W - S) + o_c, tl.sum(b_acc, 0), mask=m_e)
