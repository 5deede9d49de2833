"""Triton kernels of mixed chunk attention (seed §3.2, Eqs. 6-8, Codes 1 and 8): the chunk-matrix and GEMM
products; the state walks and their start fix-up are in :mod:`.walk`, the plan tables' kernels with the plan.

Notation: ``S`` key width, ``E`` value width, ``H`` heads, ``C`` chunk size, ``NC`` chunks; chunks
are laid out per sequence (every sequence starts a chunk, its last one may be short) and numbered
consecutively, with first token ``CH_START[c]`` and length ``CH_LEN[c]``; tokens are rows of the
flat ``[B * T, H, D]`` inputs.  ``BG`` is the tile of the chunk matrices: row tile ``m`` of chunk
``c`` covers in-chunk positions ``[m * BG, (m + 1) * BG)``.

Per chunk the op is two GEMMs and their transposes::

    A_c  = relu(scale Qq Kq^T + b)^2, causal-masked   [C, C]   (Eq. 6)   chunk_state_kernel's extra programs
    O_c  = wq_c Ql H_c + A_c V                        [C, E]   (Eqs. 6, 8) mc_gemm_kernel
    H_c  = kv0 + sum over earlier chunks of wf Kl^T V [S, E]   (Eq. 8)   chunk_state_kernel

``A`` (input dtype, ``T * C`` elements: a sixteenth of ``v`` at ``C = 256, E = 2048``) and the
per-chunk states ``H`` (SDT, ``dot_config``) are materialised, so each big product runs once with
GEMM-shaped tiles instead of being recomputed per ``E`` tile.  Backward (``G_c`` = the gradient
flowing into chunk ``c``'s ``k_lin^T v``: the reverse state pass on ``(q_lin, do)``)::

    dP_c = do V^T -> dS = 2 relu(s) dP  [C, C]        mc_dred_kernel (K = E, one launch
    dQl = wq do H^T, dKl = wf V G^T     [C, S]                        for both)
    dQq = scale dS Kq, dKq = scale dS^T Qq, db        mc_dqk_kernel  (K = C)
    dV  = wf Kl G + A^T do              [C, E]        mc_gemm_kernel (transposed A)
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _row_tile(pid, CH_START, CH_LEN, NMT, BG: tl.constexpr):
    """Chunk ``c``, its first token ``cs`` (int64), length ``cl`` and row-tile offset ``m0``."""
    c = pid // NMT
    m0 = (pid % NMT) * BG
    cs = tl.load(CH_START + c).to(tl.int64)
    cl = tl.load(CH_LEN + c)
    return c, cs, cl, m0


@triton.jit
def _gram(X, Y, rows_x, rows_y, m_x, m_y, D, BD: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
          PREC: tl.constexpr):
    """``X[rows_x] . Y[rows_y]^T`` over all ``D`` columns of two ``D``-wide row-major matrices (masked rows
    give zeros), fp32 ``[BX, BY]``: the scores ``q_quad . k_quad`` and ``do . v`` of the kernels below."""
    o_d = tl.arange(0, BD)
    acc = tl.zeros([BX, BY], dtype=tl.float32)
    for d0 in range(0, D, BD):
        m_d = (d0 + o_d) < D
        b_x = tl.load(X + rows_x[:, None] * D + d0 + o_d[None, :], mask=m_x[:, None] & m_d[None, :], other=0.0)
        b_y = tl.load(Y + rows_y[:, None] * D + d0 + o_d[None, :], mask=m_y[:, None] & m_d[None, :], other=0.0)
        acc = tl.dot(b_x, tl.trans(b_y), acc, input_precision=PREC)
    return acc


@triton.jit
def _gram_tma(DX, DY, r_x, r_y, col0, D, BD: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr,
              PREC: tl.constexpr):
    """:func:`_gram` through TMA descriptors: rows ``r_x`` / ``r_y`` onwards of the ``D`` columns from ``col0``
    (whole tiles; rows past the caller's range are loaded and must be masked by it)."""
    acc = tl.zeros([BX, BY], dtype=tl.float32)
    for d0 in range(0, D, BD):
        b_x = DX.load([r_x, col0 + d0])
        b_y = DY.load([r_y, col0 + d0])
        acc = tl.dot(b_x, tl.trans(b_y), acc, input_precision=PREC)
    return acc


@triton.jit
def _live(m0, n0, cl, CAUSAL: tl.constexpr):
    """Whether the chunk-matrix tile at rows ``m0`` and keys ``n0`` holds any entry of a chunk of ``cl`` tokens
    (causal: on or below the diagonal)."""
    live = (m0 < cl) & (n0 < cl)
    if CAUSAL:
        live = live & (n0 <= m0)
    return live


@triton.jit
def _scores(QQ, KQ, BIAS, rows_m, rows_n, o_m, o_n, m_m, m_n, i_h, scale, S, C, LB,
            BG: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """``scale q_quad . k_quad + b[i - j]`` of one ``[BG, BG]`` tile (fp32; the bias ``[H, 2C - 1]``)."""
    b_s = _gram(QQ, KQ, rows_m, rows_n, m_m, m_n, S, BS, BG, BG, PREC) * scale
    if HAS_BIAS:
        b_s += tl.load(BIAS + i_h * LB + (C - 1) + o_m[:, None] - o_n[None, :],
                       mask=m_m[:, None] & m_n[None, :], other=0.0)
    return b_s


@triton.jit
def _scores_tile(
    QQ, KQ, A, BIAS, CH_START, CH_LEN, i_m, i_n, i_h, c,
    scale, S, H, C, LB,
    BG: tl.constexpr, BS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):
    """``A[c, h, m tile, n tile] = relu(scale q_quad . k_quad + b[i - j])^2`` (seed Eq. 6) for row tile
    ``i_m`` and key tile ``i_n`` of chunk ``c``, zero where masked (keys past the chunk, future keys).
    Tiles above the diagonal (causal) or past the chunk are never read and not written."""
    cs = tl.load(CH_START + c).to(tl.int64)
    cl = tl.load(CH_LEN + c)
    m0 = i_m * BG
    n0 = i_n * BG
    if _live(m0, n0, cl, CAUSAL):
        o_m = m0 + tl.arange(0, BG)
        o_n = n0 + tl.arange(0, BG)
        m_m = o_m < cl
        m_n = o_n < cl
        b_s = _scores(QQ, KQ, BIAS, (cs + o_m) * H + i_h, (cs + o_n) * H + i_h, o_m, o_n, m_m, m_n, i_h,
                      scale, S, C, LB, BG, BS, HAS_BIAS, PREC)
        b_p = tl.maximum(b_s, 0.0)
        keep = m_n[None, :]
        if CAUSAL:
            keep = keep & (o_n[None, :] <= o_m[:, None])
        b_p = tl.where(keep, b_p * b_p, 0.0)
        p_a = A + ((c.to(tl.int64) * H + i_h) * C + o_m[:, None]) * C + o_n[None, :]
        tl.store(p_a, b_p.to(A.dtype.element_ty), mask=m_m[:, None] & (o_n < C)[None, :])


@triton.jit
def mc_gemm_kernel(
    A, Y, L, ST, DA, DY, DL, DST, W, ST_IDX, OUT, CH_START, CH_LEN,
    S, E, H, C, NMT,
    BG: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
    TRANS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, SDT: tl.constexpr, TMA: tl.constexpr,
):
    """``OUT[rows, E tile] = w_c L[rows] ST[idx_c] + A_c[rows, :] Y`` (``TRANS``: ``A_c^T``).

    Forward: ``L = q_lin, ST = H, w = wq, Y = v`` gives ``o``; backward with ``TRANS``:
    ``L = k_lin, ST = G, w = wf, Y = do`` gives ``dv``.  Grid ``(E tiles, NC * NMT, H)``.

    With ``TMA`` every tile is loaded whole through the descriptors ``DA, DY, DL, DST``: rows past a
    short chunk then come from the next chunk, which is harmless -- ``L`` / ``A`` rows past it only
    reach output rows that are not stored, and ``Y`` rows past it meet ``A`` entries that are zero
    (stored zeros of the written tiles; with ``TRANS`` the launcher zero-fills ``A`` when a chunk is short).
    """
    i_e = tl.program_id(0)
    c, cs, cl, m0 = _row_tile(tl.program_id(1), CH_START, CH_LEN, NMT, BG)
    i_h = tl.program_id(2)
    if m0 >= cl:
        return
    o_m = m0 + tl.arange(0, BG)
    m_m = o_m < cl
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    o_k = tl.arange(0, BK)
    rows_m = (cs + o_m) * H + i_h
    # linear part first, so one accumulator carries both (seed Eq. 8 / its gradient)
    w = tl.load(W + c)
    idx = tl.load(ST_IDX + c).to(tl.int64)
    p_st = ST + (idx * H + i_h) * S * E
    acc = tl.zeros([BG, BE], dtype=tl.float32)
    for s0 in range(0, S, BK):
        if TMA:
            b_l = DL.load([(cs + m0).to(tl.int32), i_h * S + s0])
            b_st = DST.load([((idx * H + i_h) * S + s0).to(tl.int32), i_e * BE])
        else:
            m_s = (s0 + o_k) < S
            b_l = tl.load(L + rows_m[:, None] * S + s0 + o_k[None, :], mask=m_m[:, None] & m_s[None, :], other=0.0)
            b_st = tl.load(p_st + (s0 + o_k)[:, None] * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :],
                           other=0.0)
        acc = tl.dot(b_l.to(SDT), b_st.to(SDT), acc, input_precision=PREC)
    acc = acc * w
    # quadratic part (seed Eq. 6): A's masked entries are stored zeros
    p_a = A + (c.to(tl.int64) * H + i_h) * C * C
    if TRANS:
        if CAUSAL:
            lo = m0
        else:
            lo = 0
        hi = cl
    else:
        lo = 0
        if CAUSAL:
            hi = tl.minimum(m0 + BG, cl)
        else:
            hi = cl
    ra = ((c * H + i_h) * C).to(tl.int32)
    for k0 in range(lo, hi, BK):
        if TMA:
            if TRANS:
                b_a = tl.trans(DA.load([ra + k0, m0]))
            else:
                b_a = DA.load([ra + m0, k0])
            b_y = DY.load([(cs + k0).to(tl.int32), i_h * E + i_e * BE])
        else:
            o_kk = k0 + o_k
            m_k = o_kk < hi
            if TRANS:
                b_a = tl.load(p_a + o_kk[None, :] * C + o_m[:, None], mask=m_m[:, None] & m_k[None, :], other=0.0)
            else:
                b_a = tl.load(p_a + o_m[:, None] * C + o_kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_y = tl.load(Y + ((cs + o_kk) * H + i_h)[:, None] * E + o_e[None, :],
                          mask=m_k[:, None] & m_e[None, :], other=0.0)
        acc = tl.dot(b_a, b_y, acc, input_precision=PREC)
    tl.store(OUT + rows_m[:, None] * E + o_e[None, :], acc.to(OUT.dtype.element_ty), mask=m_m[:, None] & m_e[None, :])


@triton.jit
def _dp_tile(
    QQ, KQ, V, DO, DS, BIAS, DDO, DV, c, cs, cl, m0, n0, i_h,
    scale, S, E, H, C, LB,
    BG: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
):
    """``dS[c, h, m tile, n tile] = 2 relu(s) (do_m . v_n)``, masked (reduction over all of ``E``; the
    scores ``s`` recomputed) for rows ``m0`` and keys ``n0`` of chunk ``c``, head ``i_h`` (tiles as
    :func:`_scores_tile`)."""
    if _live(m0, n0, cl, CAUSAL):
        o_m = m0 + tl.arange(0, BG)
        o_n = n0 + tl.arange(0, BG)
        m_m = o_m < cl
        m_n = o_n < cl
        rows_m = (cs + o_m) * H + i_h
        rows_n = (cs + o_n) * H + i_h
        if TMA:
            b_dp = _gram_tma(DDO, DV, (cs + m0).to(tl.int32), (cs + n0).to(tl.int32), i_h * E, E, BE, BG, BG, PREC)
        else:
            b_dp = _gram(DO, V, rows_m, rows_n, m_m, m_n, E, BE, BG, BG, PREC)
        b_s = _scores(QQ, KQ, BIAS, rows_m, rows_n, o_m, o_n, m_m, m_n, i_h, scale, S, C, LB, BG, BS, HAS_BIAS, PREC)
        keep = m_m[:, None] & m_n[None, :]
        if CAUSAL:
            keep = keep & (o_n[None, :] <= o_m[:, None])
        b_ds = tl.where(keep, 2.0 * tl.maximum(b_s, 0.0) * b_dp, 0.0)  # d relu(s)^2 / ds
        p_ds = DS + ((c.to(tl.int64) * H + i_h) * C + o_m[:, None]) * C + o_n[None, :]
        tl.store(p_ds, b_ds.to(DS.dtype.element_ty), mask=m_m[:, None] & (o_n < C)[None, :])


@triton.jit
def _dlin_tile(
    DO, V, HS, GS, WQ, WF, ST_IDX, DQL, DKL, DDO, DV, DHS, DGS, c, cs, cl, m0, i_s, i_h,
    S, E, H,
    BG: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr, PREC: tl.constexpr, SDT: tl.constexpr,
    TMA: tl.constexpr,
):
    """``dq_lin = wq do H_c^T``, ``dk_lin = wf v G_c^T`` for the row tile ``m0`` of chunk ``c`` and ``S``
    tile ``i_s`` (reduction over all of ``E``)."""
    if m0 < cl:
        o_m = m0 + tl.arange(0, BG)
        m_m = o_m < cl
        o_s = i_s * BS + tl.arange(0, BS)
        m_s = o_s < S
        o_e = tl.arange(0, BE)
        rows_m = (cs + o_m) * H + i_h
        idx = tl.load(ST_IDX + c).to(tl.int64)
        p_h = HS + (idx * H + i_h) * S * E
        p_g = GS + (idx * H + i_h) * S * E
        b_dql = tl.zeros([BG, BS], dtype=tl.float32)
        b_dkl = tl.zeros([BG, BS], dtype=tl.float32)
        if TMA:  # whole tiles: rows past a short chunk reach only unstored output rows
            r_m = (cs + m0).to(tl.int32)
            r_s = ((idx * H + i_h) * S + i_s * BS).to(tl.int32)
            for e0 in range(0, E, BE):
                b_do = DDO.load([r_m, i_h * E + e0])
                b_v = DV.load([r_m, i_h * E + e0])
                b_h = DHS.load([r_s, e0])
                b_g = DGS.load([r_s, e0])
                b_dql = tl.dot(b_do.to(SDT), tl.trans(b_h.to(SDT)), b_dql, input_precision=PREC)
                b_dkl = tl.dot(b_v.to(SDT), tl.trans(b_g.to(SDT)), b_dkl, input_precision=PREC)
        else:
            for e0 in range(0, E, BE):
                m_e = (e0 + o_e) < E
                m_me = m_m[:, None] & m_e[None, :]
                m_se = m_s[:, None] & m_e[None, :]
                b_do = tl.load(DO + rows_m[:, None] * E + e0 + o_e[None, :], mask=m_me, other=0.0)
                b_v = tl.load(V + rows_m[:, None] * E + e0 + o_e[None, :], mask=m_me, other=0.0)
                b_h = tl.load(p_h + o_s[:, None] * E + e0 + o_e[None, :], mask=m_se, other=0.0)
                b_g = tl.load(p_g + o_s[:, None] * E + e0 + o_e[None, :], mask=m_se, other=0.0)
                b_dql = tl.dot(b_do.to(SDT), tl.trans(b_h.to(SDT)), b_dql, input_precision=PREC)
                b_dkl = tl.dot(b_v.to(SDT), tl.trans(b_g.to(SDT)), b_dkl, input_precision=PREC)
        wq = tl.load(WQ + c)
        wf = tl.load(WF + c)
        o_ms = rows_m[:, None] * S + o_s[None, :]
        m_ms = m_m[:, None] & m_s[None, :]
        tl.store(DQL + o_ms, (wq * b_dql).to(DQL.dtype.element_ty), mask=m_ms)
        tl.store(DKL + o_ms, (wf * b_dkl).to(DKL.dtype.element_ty), mask=m_ms)


@triton.jit
def mc_dred_kernel(
    QQ, KQ, V, DO, DS, BIAS, HS, GS, WQ, WF, ST_IDX, DQL, DKL, CH_START, CH_LEN, DDO, DV, DHS, DGS,
    scale, S, E, H, C, LB, NMT,
    BG: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, SDT: tl.constexpr,
    TMA: tl.constexpr,
):
    """The backward's two reductions over ``E`` in one launch, ``dS`` (:func:`_dp_tile`) and ``dq_lin,
    dk_lin`` (:func:`_dlin_tile`): grid ``(NMT + S tiles, NC * NMT, H)``; program ``j < NMT`` of a row
    tile computes its ``dS`` tile with keys ``j``, the others its ``dq_lin, dk_lin`` for ``S`` tile ``j -
    NMT``.  The programs touching one row tile's ``do`` / ``v`` rows (and the chunk's states) are
    adjacent in launch order, so those rows are read from memory about once and re-read from L2 (as two
    kernels whose grids had the key tile slowest, ``do`` was read from memory once per key tile).

    With ``TMA`` the ``do`` / ``v`` / state tiles of the reductions over ``E`` are loaded whole through the
    descriptors ``DDO, DV`` (``[B T, H E]``) and ``DHS, DGS`` (``[NC H S, E]``); rows past a short chunk then come from
    the next chunk and reach only masked entries (a little faster than pointer loads: ``docs/design/kernels.md``)."""
    j = tl.program_id(0)
    c, cs, cl, m0 = _row_tile(tl.program_id(1), CH_START, CH_LEN, NMT, BG)
    i_h = tl.program_id(2)
    if j < NMT:
        _dp_tile(QQ, KQ, V, DO, DS, BIAS, DDO, DV, c, cs, cl, m0, j * BG, i_h,
                 scale, S, E, H, C, LB, BG, BS, BE, CAUSAL, HAS_BIAS, PREC, TMA)
    else:
        _dlin_tile(DO, V, HS, GS, WQ, WF, ST_IDX, DQL, DKL, DDO, DV, DHS, DGS, c, cs, cl, m0, j - NMT, i_h,
                   S, E, H, BG, BS, BE, PREC, SDT, TMA)


@triton.jit
def mc_dqk_kernel(
    QQ, KQ, DS, DQQ, DKQ, DB, CH_START, CH_LEN,
    scale, S, H, C, NMT, NTD,
    BG: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr, NEED_DB: tl.constexpr, PREC: tl.constexpr,
):
    """``dq_quad[m] = scale sum_n dS[m, n] k_quad[n]``, ``dk_quad[m] = scale sum_i dS[i, m]^T q_quad[i]``
    for one row tile and ``S`` tile; with ``NEED_DB`` (first ``S`` tile only) the tiles
    ``dS[m, n]`` are summed per tile diagonal into ``DB [H, NTD, BG, BG]`` (fp32 atomics: every
    chunk adds to the same bias).  Grid ``(S tiles, NC * NMT, H)``."""
    i_s = tl.program_id(0)
    c, cs, cl, m0 = _row_tile(tl.program_id(1), CH_START, CH_LEN, NMT, BG)
    i_h = tl.program_id(2)
    if m0 >= cl:
        return
    o_m = m0 + tl.arange(0, BG)
    m_m = o_m < cl
    o_b = tl.arange(0, BG)
    o_s = i_s * BS + tl.arange(0, BS)
    m_s = o_s < S
    p_ds = DS + (c.to(tl.int64) * H + i_h) * C * C
    mid = (NTD - 1) // 2
    b_dq = tl.zeros([BG, BS], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(m0 + BG, cl)
    else:
        hi = cl
    for n0 in range(0, hi, BG):
        o_n = n0 + o_b
        m_n = o_n < cl
        b_ds = tl.load(p_ds + o_m[:, None] * C + o_n[None, :], mask=m_m[:, None] & m_n[None, :], other=0.0)
        b_k = tl.load(KQ + ((cs + o_n) * H + i_h)[:, None] * S + o_s[None, :], mask=m_n[:, None] & m_s[None, :],
                      other=0.0)
        b_dq = tl.dot(b_ds, b_k, b_dq, input_precision=PREC)
        if NEED_DB:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
            if i_s == 0:
                p_db = DB + ((i_h * NTD + (m0 - n0) // BG + mid) * BG + o_b[:, None]) * BG + o_b[None, :]
                tl.atomic_add(p_db, b_ds.to(tl.float32), sem="relaxed")
    if CAUSAL:
        lo = m0
    else:
        lo = 0
    b_dk = tl.zeros([BG, BS], dtype=tl.float32)
    for i0 in range(lo, cl, BG):
        o_i = i0 + o_b
        m_i = o_i < cl
        b_dst = tl.load(p_ds + o_i[None, :] * C + o_m[:, None], mask=m_m[:, None] & m_i[None, :], other=0.0)
        b_q = tl.load(QQ + ((cs + o_i) * H + i_h)[:, None] * S + o_s[None, :], mask=m_i[:, None] & m_s[None, :],
                      other=0.0)
        b_dk = tl.dot(b_dst, b_q, b_dk, input_precision=PREC)
    rows_m = (cs + o_m) * H + i_h
    m_ms = m_m[:, None] & m_s[None, :]
    tl.store(DQQ + rows_m[:, None] * S + o_s[None, :], (scale * b_dq).to(DQQ.dtype.element_ty), mask=m_ms)
    tl.store(DKQ + rows_m[:, None] * S + o_s[None, :], (scale * b_dk).to(DKQ.dtype.element_ty), mask=m_ms)
