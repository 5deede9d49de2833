"""Triton kernels of :func:`lintime.modules.gau_heads` (forward and backward).

Notation: ``TT = B * T`` rows (tokens) of the flat ``[TT, W]`` projection ``h``, ``W = GE + S``
with ``GE = 2E`` (gating) or ``E``; ``NH`` heads of width ``S``; RoPE groups of ``D = 2 HD``
features (``S / D`` groups).  ``BT x BE`` tiles of ``u`` / ``v``; ``BTH`` rows per heads program;
``BH`` (a power of two >= ``S / 2``) half-columns of the heads tiles.

One 1-D grid of two kinds of programs: first ``NHB = cdiv(TT, BTH)`` *heads* programs (the heavier
ones, scheduled first so that none is left for the tail), each owning the ``z`` columns of its rows
and every head; then ``cdiv(TT, BT) * (NU + NE)`` *tile* programs, row-major over ``NU`` ``u``
tiles (``NU = NE = cdiv(E, BE)`` with gating, 0 without) and ``NE`` ``v`` tiles.  Every element of
``h`` is read by exactly one program, once.  The backward runs the two kinds as two kernels (one grid would give
the streaming tile programs the heads programs' register count, and their occupancy): heads programs of ``RB``
blocks of ``BTH`` rows, tile programs of ``TR`` tiles of ``BT`` rows, each storing one partial row of its column
sums (``dgamma``, ``dbeta``, the bias gradient) per program and column range.

The heads program works on half-columns ``j < S / 2``: ``j`` is feature ``i = j % HD`` of group
``j // HD``, whose two halves sit at ``c1 = (j // HD) D + i`` and ``c2 = c1 + HD`` -- so the
rotation pairs ``(x1, x2)`` are two ``[BTH, BH]`` tiles and one ``cos / sin`` tile serves every
head.  Everything is computed in fp32 registers and rounded once, when stored.

Head ``n``'s rows (``heads`` or its gradient) start at ``q<n> + n HS`` with row stride ``SQ``: one stacked
``[TT, NH, S]`` tensor passes it as every ``q<n>`` with ``HS = S, SQ = NH S``; ``NH <= 6`` separate
``[TT, 1, S]`` tensors pass ``HS = 0, SQ = S`` (Triton has no pointer lists: six arguments, picked at
compile time by :func:`_pick`).  ``bias`` (optional, ``[W]``): the projection's bias, added by the kernels
(rounded to ``h``'s dtype, then in fp32) instead of the product's epilogue, so that its gradient comes from
the backward's registers.  A backward heads program walks ``RB`` blocks of ``BTH`` rows and keeps the per-row
terms of ``dgamma`` / ``dbeta`` / the bias in registers (``[BTH, BH]`` tiles, one per head, half and quantity:
:func:`_add_at`), sums them over rows once and stores one partial row; :func:`lintime.ops.fold.fold_rows` folds those rows.
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
def _rounded(row, cols, mask, DT: tl.constexpr):
    """``row[cols]`` of a parameter (``gamma``, ``beta``, ``bias``) rounded to ``DT`` (``h``'s dtype), as fp32."""
    return tl.load(row + cols, mask=mask, other=0.).to(DT).to(tl.float32)


@triton.jit
def _z_halves(h, bias, o_t, c1, c2, m_j, m_h, W, S: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr):
    """The rows ``o_t`` of ``z``'s pre-activation (``h``'s last ``S`` columns, plus the bias's), as the two fp32
    ``[BTH, BH]`` halves ``c1``, ``c2`` of :func:`_rope_layout`."""
    p_z = h + o_t[:, None] * W + (W - S)
    b_z1 = tl.load(p_z + c1[None, :], mask=m_h, other=0.).to(tl.float32)
    b_z2 = tl.load(p_z + c2[None, :], mask=m_h, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_z1 += _rounded(bias, W - S + c1, m_j, DT)[None, :]
        b_z2 += _rounded(bias, W - S + c2, m_j, DT)[None, :]
    return b_z1, b_z2


@triton.jit
def _pick(n: tl.constexpr, q0, q1, q2, q3, q4, q5):
    """``q<n>`` for a compile-time ``n`` (``q5`` for ``n >= 5``)."""
    if n == 0:
        p = q0
    elif n == 1:
        p = q1
    elif n == 2:
        p = q2
    elif n == 3:
        p = q3
    elif n == 4:
        p = q4
    else:
        p = q5
    return p


@triton.jit
def _add_at(n: tl.constexpr, x, a0, a1, a2, a3, a4, a5):
    """``a<n> += x`` for a compile-time ``n`` (``a5`` for ``n >= 5``), the six returned: per-head accumulators in
    registers (Triton has no indexed register tensors; a head-masked update of one ``[NH, ...]`` tile costs ``NH``
    times the work)."""
    if n == 0:
        a0 += x
    elif n == 1:
        a1 += x
    elif n == 2:
        a2 += x
    elif n == 3:
        a3 += x
    elif n == 4:
        a4 += x
    else:
        a5 += x
    return a0, a1, a2, a3, a4, a5


@triton.jit
def _tile_of(q, E, GATING: tl.constexpr, BE: tl.constexpr):
    """Tile program ``q`` (counted from the first tile program): whether its tile is ``v``, its row group ``i_r``
    (int64: the index of its rows' block, in the caller's unit), its columns in ``h [TT, W]`` and in ``u`` / ``v [TT,
    E]``, and their mask."""
    NE = tl.cdiv(E, BE)
    if GATING:
        NU = NE
    else:
        NU = 0
    i_r, i_c = q // (NU + NE), q % (NU + NE)  # row-major (column-major measured no faster)
    is_v = i_c >= NU
    o_e = (i_c - is_v.to(tl.int32) * NU) * BE + tl.arange(0, BE)
    if GATING:
        c0 = is_v.to(tl.int32) * E  # v's columns follow u's
    else:
        c0 = 0
    return is_v, i_r.to(tl.int64), c0 + o_e, o_e, o_e < E


@triton.jit
def _tile(pid, NHB, TT, E, W, GATING: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    """The ``u`` / ``v`` tile of tile program ``pid`` (one row tile): whether it is ``v``, the offsets of its
    elements in ``h [TT, W]`` and in ``u`` / ``v [TT, E]``, their mask and their ``h`` columns."""
    is_v, i_r, o_c, o_e, m_c = _tile_of(pid - NHB, E, GATING, BE)
    o_t = i_r * BT + tl.arange(0, BT)
    o_h = o_t[:, None] * W + o_c[None, :]
    o_o = o_t[:, None] * E + o_e[None, :]
    return is_v, o_h, o_o, (o_t < TT)[:, None] & m_c[None, :], o_c


@triton.jit
def _rope_layout(freq, p_pos, i_r, TT, S: tl.constexpr, HD: tl.constexpr, BTH: tl.constexpr,
                 BH: tl.constexpr):
    """Rows ``o_t`` (int64) of heads program ``i_r``, the half-columns' feature offsets ``c1, c2``,
    masks and the ``cos / sin [BTH, BH]`` tiles of the angles ``p * freq[i]`` (fp32, as RoPE in
    the layers: the same fp32 position and inverse frequency, one rounded product)."""
    o_t = i_r.to(tl.int64) * BTH + tl.arange(0, BTH)
    m_t = o_t < TT
    o_j = tl.arange(0, BH)
    m_j = o_j < S // 2
    o_i = o_j % HD
    c1 = (o_j // HD) * (2 * HD) + o_i
    c2 = c1 + HD
    b_p = tl.load(p_pos + o_t, mask=m_t, other=0).to(tl.float32)
    b_f = tl.load(freq + o_i, mask=m_j, other=0.)
    b_a = b_p[:, None] * b_f[None, :]  # seed Code 3: angle = position * inv_freq
    return o_t, c1, c2, m_j, m_t[:, None] & m_j[None, :], tl.cos(b_a), tl.sin(b_a)


@triton.jit
def gau_heads_fwd_kernel(
    h, bias, u, v, q0, q1, q2, q3, q4, q5, gamma, beta, p_pos, freq,
    TT, E, W, SQ,
    S: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, HS: tl.constexpr, GATING: tl.constexpr,
    HAS_BIAS: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BTH: tl.constexpr, BH: tl.constexpr,
):
    """``u, v = silu(h[:, :GE])`` split, head ``n = rope(silu(z) gamma[n] + beta[n])`` (gamma and beta
    rounded to ``h``'s dtype, ScaleOffset's rule) at ``q<n> + n HS``.  ``u`` is unused without ``GATING``.
    With ``HAS_BIAS`` every ``h`` element is ``h + bias[column]`` (``bias`` rounded to ``h``'s dtype, added in
    fp32)."""
    pid = tl.program_id(0)
    DT = v.dtype.element_ty
    NHB = tl.cdiv(TT, BTH)
    if pid < NHB:  # z and the heads
        o_t, c1, c2, m_j, m_h, b_cos, b_sin = _rope_layout(freq, p_pos, pid, TT, S, HD, BTH, BH)
        b_z1, b_z2 = _z_halves(h, bias, o_t, c1, c2, m_j, m_h, W, S, HAS_BIAS, DT)
        b_z1 = b_z1 / (1.0 + tl.exp(-b_z1))  # silu (seed Code 6)
        b_z2 = b_z2 / (1.0 + tl.exp(-b_z2))
        for n in tl.static_range(NH):
            b_g1 = _rounded(gamma + n * S, c1, m_j, DT)
            b_g2 = _rounded(gamma + n * S, c2, m_j, DT)
            b_b1 = _rounded(beta + n * S, c1, m_j, DT)
            b_b2 = _rounded(beta + n * S, c2, m_j, DT)
            b_q1 = b_z1 * b_g1[None, :] + b_b1[None, :]  # scale + offset (seed Code 6)
            b_q2 = b_z2 * b_g2[None, :] + b_b2[None, :]
            p_o = _pick(n, q0, q1, q2, q3, q4, q5) + n * HS + o_t[:, None] * SQ
            tl.store(p_o + c1[None, :], (b_q1 * b_cos - b_q2 * b_sin).to(DT), mask=m_h)
            tl.store(p_o + c2[None, :], (b_q2 * b_cos + b_q1 * b_sin).to(DT), mask=m_h)
    else:  # a u or v tile: silu
        is_v, o_h, o_o, m_e, o_c = _tile(pid, NHB, TT, E, W, GATING, BT, BE)
        b_x = tl.load(h + o_h, mask=m_e, other=0.).to(tl.float32)
        if HAS_BIAS:
            b_x += _rounded(bias, o_c, o_c < W, DT)[None, :]
        b_y = (b_x / (1.0 + tl.exp(-b_x))).to(DT)
        if is_v:
            tl.store(v + o_o, b_y, mask=m_e)
        else:
            tl.store(u + o_o, b_y, mask=m_e)


@triton.jit
def gau_heads_bwd_kernel(
    h, bias, dq0, dq1, dq2, dq3, dq4, dq5, gamma, p_pos, freq, dh, dgamma_part, dbeta_part, dbias_part,
    TT, W, SQ,
    S: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, HS: tl.constexpr,
    HAS_DQ: tl.constexpr, NEED_DP: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr,
    BTH: tl.constexpr, RB: tl.constexpr, BH: tl.constexpr,
):
    """The heads' part of ``dh`` (the ``z`` columns; absent head gradients count as zero: bit ``n`` of ``HAS_DQ``
    says whether head ``n``'s gradient ``dq<n> + n HS`` exists), one program per ``RB`` blocks of ``BTH`` rows,
    and with ``NEED_DP`` the program's partial sums of ``dgamma`` and ``dbeta`` (``[NH, S]`` fp32 at row ``pid`` of
    ``dgamma_part`` / ``dbeta_part``).  ``HAS_BIAS``: the forward added ``bias`` (recomputed here); ``NEED_DB``:
    the program's column sums of ``dz`` (fp32, before rounding) go to row ``pid`` of ``dbias_part [G, S]`` (the
    ``z`` columns' bias).  Partial rows are folded by :func:`lintime.ops.fold.fold_rows` (deterministic).

    The heads' backward: un-rotate (``dq1 = do1 cos + do2 sin``, ``dq2 = do2 cos - do1 sin``), then
    ``dgamma[n] += dq silu(z)``, ``dbeta[n] += dq``, ``d silu(z) = sum_n dq gamma[n]``.  A kernel of its own (not
    programs of the tile kernel's grid, as in the forward): its registers would cap the streaming tile programs'
    occupancy."""
    pid = tl.program_id(0)
    DT = dh.dtype.element_ty
    # this program's per-row terms of dgamma / dbeta, one [BTH, BH] tile per head, half and quantity, summed over
    # rows once after the loop: one [NH, BTH, BH] tile per quantity updated through a head mask does nh times the
    # work, and row sums per block inside the loop were slower still
    z = tl.zeros([BTH, BH], dtype=tl.float32)
    g1_0, g1_1, g1_2, g1_3, g1_4, g1_5 = z, z, z, z, z, z  # dq1 silu(z1) of head n (dgamma, first halves)
    g2_0, g2_1, g2_2, g2_3, g2_4, g2_5 = z, z, z, z, z, z
    b1_0, b1_1, b1_2, b1_3, b1_4, b1_5 = z, z, z, z, z, z  # dq1 of head n (dbeta)
    b2_0, b2_1, b2_2, b2_3, b2_4, b2_5 = z, z, z, z, z, z
    b_db1 = z  # d bias of the z columns, per row
    b_db2 = z
    for i_b in range(RB):
        o_t, c1, c2, m_j, m_h, b_cos, b_sin = _rope_layout(freq, p_pos, pid * RB + i_b, TT, S, HD, BTH, BH)
        b_z1, b_z2 = _z_halves(h, bias, o_t, c1, c2, m_j, m_h, W, S, HAS_BIAS, DT)
        b_ds1 = tl.zeros([BTH, BH], dtype=tl.float32)  # d silu(z)
        b_ds2 = tl.zeros([BTH, BH], dtype=tl.float32)
        b_s1 = b_z1 / (1.0 + tl.exp(-b_z1))
        b_s2 = b_z2 / (1.0 + tl.exp(-b_z2))
        for n in tl.static_range(NH):
            if (HAS_DQ >> n) & 1:
                p_d = _pick(n, dq0, dq1, dq2, dq3, dq4, dq5) + n * HS + o_t[:, None] * SQ
                b_do1 = tl.load(p_d + c1[None, :], mask=m_h, other=0.).to(tl.float32)
                b_do2 = tl.load(p_d + c2[None, :], mask=m_h, other=0.).to(tl.float32)
                b_dq1 = b_do1 * b_cos + b_do2 * b_sin  # the transposed rotation
                b_dq2 = b_do2 * b_cos - b_do1 * b_sin
                b_g1 = _rounded(gamma + n * S, c1, m_j, DT)
                b_g2 = _rounded(gamma + n * S, c2, m_j, DT)
                b_ds1 += b_dq1 * b_g1[None, :]
                b_ds2 += b_dq2 * b_g2[None, :]
                if NEED_DP:  # padding rows hold dq = 0
                    g1_0, g1_1, g1_2, g1_3, g1_4, g1_5 = _add_at(n, b_dq1 * b_s1, g1_0, g1_1, g1_2, g1_3, g1_4, g1_5)
                    g2_0, g2_1, g2_2, g2_3, g2_4, g2_5 = _add_at(n, b_dq2 * b_s2, g2_0, g2_1, g2_2, g2_3, g2_4, g2_5)
                    b1_0, b1_1, b1_2, b1_3, b1_4, b1_5 = _add_at(n, b_dq1, b1_0, b1_1, b1_2, b1_3, b1_4, b1_5)
                    b2_0, b2_1, b2_2, b2_3, b2_4, b2_5 = _add_at(n, b_dq2, b2_0, b2_1, b2_2, b2_3, b2_4, b2_5)
        b_dz1 = b_ds1 * _silu_grad(b_z1)  # padding rows: 0
        b_dz2 = b_ds2 * _silu_grad(b_z2)
        p_dz = dh + o_t[:, None] * W + (W - S)
        tl.store(p_dz + c1[None, :], b_dz1.to(DT), mask=m_h)
        tl.store(p_dz + c2[None, :], b_dz2.to(DT), mask=m_h)
        if NEED_DB:
            b_db1 += b_dz1
            b_db2 += b_dz2
    o_j = tl.arange(0, BH)
    c1 = (o_j // HD) * (2 * HD) + o_j % HD
    m_j = o_j < S // 2
    if NEED_DP:
        for n in tl.static_range(NH):  # heads without a gradient store their zeros
            o_p = (pid.to(tl.int64) * NH + n) * S
            tl.store(dgamma_part + o_p + c1, tl.sum(_pick(n, g1_0, g1_1, g1_2, g1_3, g1_4, g1_5), 0), mask=m_j)
            tl.store(dgamma_part + o_p + c1 + HD, tl.sum(_pick(n, g2_0, g2_1, g2_2, g2_3, g2_4, g2_5), 0), mask=m_j)
            tl.store(dbeta_part + o_p + c1, tl.sum(_pick(n, b1_0, b1_1, b1_2, b1_3, b1_4, b1_5), 0), mask=m_j)
            tl.store(dbeta_part + o_p + c1 + HD, tl.sum(_pick(n, b2_0, b2_1, b2_2, b2_3, b2_4, b2_5), 0), mask=m_j)
    if NEED_DB:
        p_b = dbias_part + pid.to(tl.int64) * S
        tl.store(p_b + c1, tl.sum(b_db1, 0), mask=m_j)
        tl.store(p_b + c1 + HD, tl.sum(b_db2, 0), mask=m_j)


@triton.jit
def gau_heads_bwd_tiles_kernel(
    h, bias, du, dv, dh, dbias_part,
    TT, E, W, S,
    GATING: tl.constexpr, HAS_DU: tl.constexpr, HAS_DV: tl.constexpr, HAS_BIAS: tl.constexpr,
    NEED_DB: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, TR: tl.constexpr,
):
    """The ``u`` / ``v`` part of ``dh``: program ``q`` owns one ``BE``-column tile of ``u`` or ``v`` over ``TR``
    tiles of ``BT`` rows (row-major over the ``NU + NE`` column tiles; an absent gradient counts as zero).
    ``NEED_DB``: the column sums of ``dh`` (fp32, before rounding) over the program's rows go to row ``q // (NU +
    NE)`` of ``dbias_part [G, W - S]`` (the ``u``, ``v`` columns' bias)."""
    q = tl.program_id(0)
    DT = dh.dtype.element_ty
    is_v, i_g, o_c, o_e, m_c = _tile_of(q, E, GATING, BE)
    if HAS_BIAS:
        b_b = _rounded(bias, o_c, m_c, DT)[None, :]
    b_db = tl.zeros([BT, BE], dtype=tl.float32)  # d bias, per row
    for i_r in range(TR):
        o_t = (i_g * TR + i_r) * BT + tl.arange(0, BT)
        m_e = (o_t < TT)[:, None] & m_c[None, :]
        o_o = o_t[:, None] * E + o_e[None, :]
        b_dy = tl.zeros([BT, BE], dtype=tl.float32)
        if is_v:
            if HAS_DV:
                b_dy = tl.load(dv + o_o, mask=m_e, other=0.).to(tl.float32)
        else:
            if HAS_DU:
                b_dy = tl.load(du + o_o, mask=m_e, other=0.).to(tl.float32)
        o_h = o_t[:, None] * W + o_c[None, :]
        b_x = tl.load(h + o_h, mask=m_e, other=0.).to(tl.float32)
        if HAS_BIAS:
            b_x += b_b
        b_d = b_dy * _silu_grad(b_x)  # masked elements: 0
        tl.store(dh + o_h, b_d.to(DT), mask=m_e)
        if NEED_DB:
            b_db += b_d
    if NEED_DB:
        tl.store(dbias_part + i_g * (W - S) + o_c, tl.sum(b_db, 0), mask=m_c)
