"""Triton kernels of GAU attention: relu^2 attention inside regions (a region is a sequence).

Notation: ``S`` query/key width, ``E`` value width, ``H`` heads; tokens are rows of the packed
``[B * T, H, D]`` inputs (token stride ``H * D``).  A *region* is a run of tokens that attend to
each other (a whole sequence); a *tile* is ``BM``
consecutive tokens of a region starting at a multiple of ``BM`` (``BM == BN``).  Tables give, per
tile, its region (``TILE_REG``) and offset (``TILE_OFF``), and per region its first token
(``REG_START``) and length (``REG_LEN``).  Offsets ``i, j`` below are positions inside the region.

Scores (seed Eq. 5, Code 6): ``s_ij = scale * q_i . k_j + b[i - j]`` with
``b[i - j] = rel_bias[h, (i - j) + T - 1]``, read from its tiles per tile diagonal (:func:`_bias_tile`);
weights ``p = relu(s)^2``; ``o_i = sum_j p_ij v_j`` over ``j <= i`` (causal) or the whole region.  No normaliser, so tiles add up in fp32 and no ``T x T``
tensor is ever formed.

Backward (``ds = 2 relu(s) dp``, ``dp = do . v``):

* :func:`relu2_bwd_dv_kernel`, per (key tile, ``E`` tile): ``dv_j = sum_i p_ij do_i``, scores
  recomputed;
* :func:`relu2_bwd_dqk_kernel`, per row tile: ``dp`` reduced over all of ``E``, then ``dq`` (kept by
  the program), ``dk`` (fp32 atomics: key tiles get contributions from several query tiles) and
  the bias gradient, summed per tile diagonal into ``DB [H, NTD, BM, BN]`` (every tile pair on one
  tile diagonal sees the same bias slice; the host folds the tiles into ``[H, LB]``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_scores(p_a, p_b, m_a, m_b, S, o_s, b_a, ONE_S: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr,
                 NA: tl.constexpr, NB: tl.constexpr):
    """``a . b^T`` over ``S`` for row pointers ``p_a [NA]`` and ``p_b [NB]``; ``b_a`` is the
    preloaded ``a`` tile when ``ONE_S`` (``S <= BS``)."""
    if ONE_S:
        m_s = o_s < S
        b_b = tl.load(p_b[:, None] + o_s[None, :], mask=m_b[:, None] & m_s[None, :], other=0.0)
        acc = tl.dot(b_a, tl.trans(b_b), input_precision=PREC)
    else:
        acc = tl.zeros([NA, NB], dtype=tl.float32)
        for s0 in range(0, S, BS):
            m_s = (s0 + o_s) < S
            a = tl.load(p_a[:, None] + s0 + o_s[None, :], mask=m_a[:, None] & m_s[None, :], other=0.0)
            b = tl.load(p_b[:, None] + s0 + o_s[None, :], mask=m_b[:, None] & m_s[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(b), input_precision=PREC)
    return acc


@triton.jit
def _bias_tile(BIAS, DB_, i_h, m0, n0, NTD, BM: tl.constexpr, TMA: tl.constexpr):
    """The ``[BM, BM]`` bias tile of query tile ``m0`` and key tile ``n0``: ``b[i - j]`` depends only on the
    tile diagonal ``(m0 - n0) / BM``, so the launcher lays the bias out as one tile per tile diagonal
    (``BIAS [H, NTD, BM, BM]``, :func:`lintime.ops.gau.triton.launch.bias_tiles`) and this is a contiguous load
    from L2, with ``TMA`` (the kernels' ``TMA_BIAS``) through the descriptor ``DB_`` (the tiles as ``[H NTD BM,
    BM]``), cheaper than a ``[BM, BM]`` gather per tile."""
    td = (m0 - n0) // BM + (NTD - 1) // 2
    if TMA:
        return DB_.load([((i_h * NTD + td) * BM).to(tl.int32), 0])
    o_b = tl.arange(0, BM)
    return tl.load(BIAS + ((i_h * NTD + td).to(tl.int64) * BM + o_b[:, None]) * BM + o_b[None, :])


@triton.jit
def relu2_fwd_kernel(
    Q, K, V, O, BIAS, DQ_, DK_, DV_, DB_,
    TILE_REG, TILE_OFF, REG_START, REG_LEN,
    scale, S, E, H, NTD,
    BM: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_S: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    TMA_BIAS: tl.constexpr,
):
    """``O[tile, E tile] = sum_j relu2(s_ij) v_j``; grid ``(E tiles, tiles, H)``; the bias as tiles per tile
    diagonal (:func:`_bias_tile`).  With ``TMA`` (``S == BS``)
    ``q, k, v`` load as whole tiles through the descriptors ``DQ_, DK_, DV_`` (rows past the region
    meet zero weights)."""
    i_e, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.load(TILE_REG + i_t)
    m0 = tl.load(TILE_OFF + i_t)
    rs = tl.load(REG_START + r).to(tl.int64)
    rl = tl.load(REG_LEN + r)
    o_m = m0 + tl.arange(0, BM)
    m_m = o_m < rl
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    o_s = tl.arange(0, BS)
    p_q = Q + ((rs + o_m) * H + i_h) * S  # [BM] row pointers
    b_q = tl.zeros([BM, BS], dtype=Q.dtype.element_ty)
    if TMA:
        b_q = DQ_.load([(rs + m0).to(tl.int32), i_h * S])
    elif ONE_S:
        b_q = tl.load(p_q[:, None] + o_s[None, :], mask=m_m[:, None] & (o_s < S)[None, :], other=0.0)
    if CAUSAL:
        hi = tl.minimum(m0 + BM, rl)
    else:
        hi = rl
    acc = tl.zeros([BM, BE], dtype=tl.float32)
    for n0 in range(0, hi, BM):
        o_n = n0 + tl.arange(0, BM)
        m_n = o_n < rl
        if TMA:
            b_s = tl.dot(b_q, tl.trans(DK_.load([(rs + n0).to(tl.int32), i_h * S])), input_precision=PREC) * scale
        else:
            p_k = K + ((rs + o_n) * H + i_h) * S
            b_s = _tile_scores(p_q, p_k, m_m, m_n, S, o_s, b_q, ONE_S, BS, PREC, BM, BM) * scale
        if HAS_BIAS:
            b_s += _bias_tile(BIAS, DB_, i_h, m0, n0, NTD, BM, TMA_BIAS)
        b_p = tl.maximum(b_s, 0.0)
        keep = m_n[None, :]
        if CAUSAL:
            keep = keep & (o_n[None, :] <= o_m[:, None])
        b_p = tl.where(keep, b_p * b_p, 0.0)  # seed Eq. 5: relu^2
        if TMA:
            b_v = DV_.load([(rs + n0).to(tl.int32), i_h * E + i_e * BE])
        else:
            b_v = tl.load(V + ((rs + o_n) * H + i_h)[:, None] * E + o_e[None, :],
                          mask=m_n[:, None] & m_e[None, :], other=0.0)
        acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
    tl.store(O + ((rs + o_m) * H + i_h)[:, None] * E + o_e[None, :], acc.to(O.dtype.element_ty),
             mask=m_m[:, None] & m_e[None, :])


@triton.jit
def relu2_bwd_dv_kernel(
    Q, K, DO, DV, BIAS, DQ_, DK_, DDO_, DB_,
    TILE_REG, TILE_OFF, REG_START, REG_LEN,
    scale, S, E, H, NTD,
    BM: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, ONE_S: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    TMA_BIAS: tl.constexpr,
):
    """``DV[key tile, E tile] = sum_i relu2(s_ij) do_i``; grid ``(E tiles, tiles, H)``; ``TMA`` as in
    :func:`relu2_fwd_kernel` (descriptors ``DQ_, DK_, DDO_``)."""
    i_e, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.load(TILE_REG + i_t)
    n0 = tl.load(TILE_OFF + i_t)
    rs = tl.load(REG_START + r).to(tl.int64)
    rl = tl.load(REG_LEN + r)
    o_n = n0 + tl.arange(0, BM)
    m_n = o_n < rl
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    o_s = tl.arange(0, BS)
    p_k = K + ((rs + o_n) * H + i_h) * S
    b_k = tl.zeros([BM, BS], dtype=K.dtype.element_ty)
    if TMA:
        b_k = DK_.load([(rs + n0).to(tl.int32), i_h * S])
    elif ONE_S:
        b_k = tl.load(p_k[:, None] + o_s[None, :], mask=m_n[:, None] & (o_s < S)[None, :], other=0.0)
    if CAUSAL:
        lo = n0
    else:
        lo = 0
    acc = tl.zeros([BM, BE], dtype=tl.float32)
    for m0 in range(lo, rl, BM):
        o_m = m0 + tl.arange(0, BM)
        m_m = o_m < rl
        if TMA:
            b_st = tl.dot(b_k, tl.trans(DQ_.load([(rs + m0).to(tl.int32), i_h * S])), input_precision=PREC) * scale
        else:
            p_q = Q + ((rs + o_m) * H + i_h) * S
            b_st = _tile_scores(p_k, p_q, m_n, m_m, S, o_s, b_k, ONE_S, BS, PREC, BM, BM) * scale  # [BN, BM]
        if HAS_BIAS:
            b_st += tl.trans(_bias_tile(BIAS, DB_, i_h, m0, n0, NTD, BM, TMA_BIAS))
        b_pt = tl.maximum(b_st, 0.0)
        keep = m_m[None, :]
        if CAUSAL:
            keep = keep & (o_m[None, :] >= o_n[:, None])
        b_pt = tl.where(keep, b_pt * b_pt, 0.0)
        if TMA:
            b_do = DDO_.load([(rs + m0).to(tl.int32), i_h * E + i_e * BE])
        else:
            b_do = tl.load(DO + ((rs + o_m) * H + i_h)[:, None] * E + o_e[None, :],
                           mask=m_m[:, None] & m_e[None, :], other=0.0)
        acc += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=PREC)
    tl.store(DV + ((rs + o_n) * H + i_h)[:, None] * E + o_e[None, :], acc.to(DV.dtype.element_ty),
             mask=m_n[:, None] & m_e[None, :])


@triton.jit
def _dqk_tile(b_dp, n0, m0, o_m, m_m, rows_m, p_q, b_q, b_dq, rs, rl, i_h, p_dbs, mid,
              K, DQ, DK, BIAS, DK_, DB_, scale, S, H, NTD,
              BM: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
              NEED_DB: tl.constexpr, ONE_S: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
              TMA_BIAS: tl.constexpr):
    """Key tile ``n0`` of :func:`relu2_bwd_dqk_kernel` once ``dp = do . v^T`` is known: scores, ``ds``,
    the bias gradient, ``dq`` (returned, or read-modify-written when ``S`` is tiled) and ``dk``.  With
    ``TMA`` the key tile is loaded once through ``DK_`` for both the scores and ``dq``."""
    o_s = tl.arange(0, BS)
    o_b = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BM)
    m_n = o_n < rl
    rows_n = (rs + o_n) * H + i_h
    p_k = K + rows_n * S
    if TMA:
        b_kt = DK_.load([(rs + n0).to(tl.int32), i_h * S])
        b_s = tl.dot(b_q, tl.trans(b_kt), input_precision=PREC) * scale
    else:
        b_kt = b_q  # (unused)
        b_s = _tile_scores(p_q, p_k, m_m, m_n, S, o_s, b_q, ONE_S, BS, PREC, BM, BM) * scale
    if HAS_BIAS:
        b_s += _bias_tile(BIAS, DB_, i_h, m0, n0, NTD, BM, TMA_BIAS)
    keep = m_m[:, None] & m_n[None, :]
    if CAUSAL:
        keep = keep & (o_n[None, :] <= o_m[:, None])
    b_ds = tl.where(keep, 2.0 * tl.maximum(b_s, 0.0) * b_dp, 0.0)  # d relu(s)^2 / ds
    if NEED_DB:
        td = (m0 - n0) // BM + mid
        p_db = p_dbs + (td * BM + o_b[:, None]) * BM + o_b[None, :]
        tl.atomic_add(p_db, b_ds, sem="relaxed")
    b_ds = b_ds * scale
    if ONE_S:
        m_s = o_s < S
        if TMA:
            b_k = b_kt
        else:
            b_k = tl.load(p_k[:, None] + o_s[None, :], mask=m_n[:, None] & m_s[None, :], other=0.0)
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
        b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=PREC)
        tl.atomic_add(DK + rows_n[:, None] * S + o_s[None, :], b_dk, mask=m_n[:, None] & m_s[None, :],
                      sem="relaxed")
    else:
        for s0 in range(0, S, BS):
            m_s = (s0 + o_s) < S
            b_k = tl.load(p_k[:, None] + s0 + o_s[None, :], mask=m_n[:, None] & m_s[None, :], other=0.0)
            b_qs = tl.load(p_q[:, None] + s0 + o_s[None, :], mask=m_m[:, None] & m_s[None, :], other=0.0)
            p_dq = DQ + rows_m[:, None] * S + s0 + o_s[None, :]
            m_dq = m_m[:, None] & m_s[None, :]
            # only this program writes these rows of DQ: a plain read-modify-write
            b_dqs = tl.load(p_dq, mask=m_dq, other=0.0)
            tl.store(p_dq, b_dqs + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC), mask=m_dq)
            b_dk = tl.dot(tl.trans(b_ds.to(b_qs.dtype)), b_qs, input_precision=PREC)
            tl.atomic_add(DK + rows_n[:, None] * S + s0 + o_s[None, :], b_dk,
                          mask=m_n[:, None] & m_s[None, :], sem="relaxed")
    return b_dq


@triton.jit
def relu2_bwd_dqk_kernel(
    Q, K, V, DO, DQ, DK, DB, BIAS, DQ_, DK_, DV_, DDO_, DB_,
    TILE_REG, TILE_OFF, REG_START, REG_LEN,
    scale, S, E, H, NTD,
    BM: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, ONE_S: tl.constexpr,
    PREC: tl.constexpr, TMA: tl.constexpr, TMA_BIAS: tl.constexpr,
):
    """Per row tile: ``DQ`` (fp32, this program's rows only), ``DK`` (fp32 atomics) and the bias
    gradient per tile diagonal into ``DB [H, NTD, BM, BM]``; grid ``(tiles, H)``.  Key tiles go in
    pairs: ``dp = do . v^T`` is reduced over ``E`` for both at once, so each ``do`` tile is read
    from L2 once per pair instead of once per key tile.  With ``TMA`` the ``q`` and ``k``
    tiles and the ``do`` / ``v`` tiles of that reduction load through ``DQ_, DK_, DDO_, DV_`` (rows past the region or
    past the last key tile only reach masked or unused entries)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    r = tl.load(TILE_REG + i_t)
    m0 = tl.load(TILE_OFF + i_t)
    rs = tl.load(REG_START + r).to(tl.int64)
    rl = tl.load(REG_LEN + r)
    o_m = m0 + tl.arange(0, BM)
    m_m = o_m < rl
    o_s = tl.arange(0, BS)
    o_eb = tl.arange(0, BE)
    rows_m = (rs + o_m) * H + i_h  # [BM] token-head rows
    p_q = Q + rows_m * S
    b_q = tl.zeros([BM, BS], dtype=Q.dtype.element_ty)
    if TMA:
        b_q = DQ_.load([(rs + m0).to(tl.int32), i_h * S])
    elif ONE_S:
        b_q = tl.load(p_q[:, None] + o_s[None, :], mask=m_m[:, None] & (o_s < S)[None, :], other=0.0)
    b_dq = tl.zeros([BM, BS], dtype=tl.float32)
    if CAUSAL:
        hi = tl.minimum(m0 + BM, rl)
    else:
        hi = rl
    mid = (NTD - 1) // 2
    p_dbs = DB + i_h.to(tl.int64) * NTD * BM * BM
    nk = tl.cdiv(hi, BM)
    for j in range(0, nk, 2):
        n0 = j * BM
        n1 = n0 + BM
        o_n0 = n0 + tl.arange(0, BM)
        o_n1 = n1 + tl.arange(0, BM)
        m_n0 = o_n0 < rl
        m_n1 = o_n1 < hi  # past the last key tile of this row tile: nothing to read
        rows_n0 = (rs + o_n0) * H + i_h
        rows_n1 = (rs + o_n1) * H + i_h
        b_dp0 = tl.zeros([BM, BM], dtype=tl.float32)
        b_dp1 = tl.zeros([BM, BM], dtype=tl.float32)
        for e0 in range(0, E, BE):
            if TMA:
                b_do = DDO_.load([(rs + m0).to(tl.int32), i_h * E + e0])
                b_v0 = DV_.load([(rs + n0).to(tl.int32), i_h * E + e0])
                b_v1 = DV_.load([(rs + n1).to(tl.int32), i_h * E + e0])
            else:
                m_e = (e0 + o_eb) < E
                b_do = tl.load(DO + rows_m[:, None] * E + e0 + o_eb[None, :], mask=m_m[:, None] & m_e[None, :],
                               other=0.0)
                b_v0 = tl.load(V + rows_n0[:, None] * E + e0 + o_eb[None, :], mask=m_n0[:, None] & m_e[None, :],
                               other=0.0)
                b_v1 = tl.load(V + rows_n1[:, None] * E + e0 + o_eb[None, :], mask=m_n1[:, None] & m_e[None, :],
                               other=0.0)
            b_dp0 += tl.dot(b_do, tl.trans(b_v0), input_precision=PREC)
            b_dp1 += tl.dot(b_do, tl.trans(b_v1), input_precision=PREC)
        b_dq = _dqk_tile(b_dp0, n0, m0, o_m, m_m, rows_m, p_q, b_q, b_dq, rs, rl, i_h, p_dbs, mid,
                         K, DQ, DK, BIAS, DK_, DB_, scale, S, H, NTD,
                         BM, BS, CAUSAL, HAS_BIAS, NEED_DB, ONE_S, PREC, TMA, TMA_BIAS)
        if n1 < hi:
            b_dq = _dqk_tile(b_dp1, n1, m0, o_m, m_m, rows_m, p_q, b_q, b_dq, rs, rl, i_h, p_dbs, mid,
                             K, DQ, DK, BIAS, DK_, DB_, scale, S, H, NTD,
                             BM, BS, CAUSAL, HAS_BIAS, NEED_DB, ONE_S, PREC, TMA, TMA_BIAS)
    if ONE_S:
        tl.store(DQ + rows_m[:, None] * S + o_s[None, :], b_dq, mask=m_m[:, None] & (o_s < S)[None, :])
