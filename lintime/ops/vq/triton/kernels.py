"""Triton kernels of Transformer-VQ attention (seed Theorem 3.7, Remark 3.9, Appendix E Code 1).

Notation: ``L`` block length, ``S`` codes, ``K`` key width, ``V`` value width, ``H`` heads, ``NQ``
query blocks, ``NB`` blocks of the layout (``R * NE``, :mod:`lintime.ops.vq.chunk`), ``W = 2L``
window columns.  Every tensor is in the block layout of the chunked form:

* ``q`` ``[NQ, L, H, K]`` the queries of each query block (zero in empty slots);
* ``k``, ``v`` ``[NB, L, H, K / V]`` the keys / values of every block, ``kvalid`` ``[NB, L]`` int8;
  query block ``n`` sits at flat block ``qblk[n]``; its window is blocks ``qblk[n] - 1`` (window
  columns ``[0, L)``) and ``qblk[n]`` (columns ``[L, 2L)``);
* ``bias`` ``[NQ, L, H, W]`` window bias by column;
* ``cb`` ``[H, S, K]`` the codebook (keys of the cache, shared by every block), ``logc`` ``[NQ, H, S]``
  ``log(count)`` of the cache of each query block (``-inf`` for an empty code), ``cm`` ``[NQ, H, S, V]``
  its per-code mean values;
* ``o`` ``[NQ, L, H, V]``, ``lse`` / ``delta`` ``[NQ, L, H]`` fp32 (0 for a row with no visible key).

A query row ``i`` of block ``n`` sees window column ``j`` when ``j <= L + i`` and the key slot holds a
key, and every code of its cache (seed Eq. 28-33); one log-sum-exp covers both (Code 1).
"""

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # running-max start: finite, so a tile with every score masked (-inf) leaves it unchanged


@triton.jit
def vq_fwd_kernel(
    q, k, v, kvalid, qblk, bias, cb, logc, cm, o, lse,
    L, S, NQT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Output tile ``[BM, BV]`` of query rows ``i0 ..`` of one query block: online softmax over the window
    columns up to the causal limit, then over the ``S`` cache codes.  Grid ``(NQ * NQT, cdiv(V, BV), H)``;
    programs of V tile 0 write ``lse``.  Pointers: a scalar base per tensor and int32 offsets inside the tile
    (the window's ``2L`` keys are contiguous: blocks ``qblk[n] - 1`` and ``qblk[n]`` are adjacent)."""
    i_t, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = (i_t // NQT).to(tl.int64)
    i0 = (i_t % NQT) * BM
    w0 = (tl.load(qblk + n).to(tl.int64) - 1) * L  # first key slot of the window
    o_i = i0 + tl.arange(0, BM)
    m_i = o_i < L
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_n = tl.arange(0, BN)
    q += (n * L * H + i_h) * K
    k += (w0 * H + i_h) * K
    v += (w0 * H + i_h) * V
    kvalid += w0
    cm += (n * H + i_h) * S * V
    logc += (n * H + i_h) * S
    cb += i_h * S * K
    b_q = tl.load(q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)

    b_m = tl.full([BM], NEG, tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_o = tl.zeros([BM, BV], tl.float32)
    hi = tl.minimum(2 * L, L + i0 + BM)  # causal: no row of the tile sees a column >= L + i0 + BM
    for j0 in range(0, hi, BN):
        o_j = j0 + o_n
        m_j = o_j < 2 * L
        ok = (tl.load(kvalid + o_j, mask=m_j, other=0) != 0) & m_j
        b_k = tl.load(k + o_j[:, None] * (H * K) + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [BM, BN]
        if HAS_BIAS:
            s += tl.load(bias + (n * L * H + i_h) * (2 * L) + o_i[:, None] * (H * 2 * L) + o_j[None, :],
                         mask=m_i[:, None] & m_j[None, :], other=0.0).to(tl.float32)
        s = tl.where((o_j[None, :] <= L + o_i[:, None]) & ok[None, :], s, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(s, 1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, 1)
        b_v = tl.load(v + o_j[:, None] * (H * V) + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0.0)
        b_o = b_o * alpha[:, None] + tl.dot(p.to(DT), b_v, input_precision=PREC)
        b_m = m_new
    # the cache: codes as keys with log(count) added (seed Remark 3.9), per-code means as values
    for c0 in range(0, S, BN):
        o_c = c0 + o_n
        m_c = o_c < S
        b_k = tl.load(cb + o_c[:, None] * K + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
        lc = tl.load(logc + o_c, mask=m_c, other=float("-inf"))
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) + lc[None, :]
        m_new = tl.maximum(b_m, tl.max(s, 1))
        alpha = tl.exp(b_m - m_new)
        p = tl.exp(s - m_new[:, None])
        b_l = b_l * alpha + tl.sum(p, 1)
        b_v = tl.load(cm + o_c[:, None] * V + o_v[None, :], mask=m_c[:, None] & m_v[None, :], other=0.0)
        b_o = b_o * alpha[:, None] + tl.dot(p.to(DT), b_v, input_precision=PREC)
        b_m = m_new
    seen = b_l > 0
    b_o = b_o / tl.where(seen, b_l, 1.0)[:, None]
    o += (n * L * H + i_h) * V
    tl.store(o + o_i[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_i[:, None] & m_v[None, :])
    if i_v == 0:
        lse += n * L * H + i_h
        tl.store(lse + o_i * H, tl.where(seen, b_m + tl.log(tl.where(seen, b_l, 1.0)), 0.0), mask=m_i)


@triton.jit
def vq_bwd_query_kernel(
    q, k, v, kvalid, qblk, bias, cb, logc, cm, o, do, lse, dq, pw, dsw, pc, dsc,
    L, S, NQT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_BIAS: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """Query side of the backward for query rows ``i0 ..`` of one query block: the probabilities ``P`` and
    score gradients ``dS = P (do . v^T - rowsum(do o))`` of every window column (``pw``, ``dsw`` ``[NQ, L, H, W]``;
    ``dsw`` is the bias gradient) and cache code (``pc``, ``dsc`` ``[NQ, L, H, S]``), recomputed from ``lse``,
    and ``dq = dS k``.  Columns past the tile's causal limit are stored as zeros.  Grid ``(NQ * NQT, H)``."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    n = (i_t // NQT).to(tl.int64)
    i0 = (i_t % NQT) * BM
    w0 = (tl.load(qblk + n).to(tl.int64) - 1) * L
    W = 2 * L
    o_i = i0 + tl.arange(0, BM)
    m_i = o_i < L
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, BN)
    o_bv = tl.arange(0, BV)
    tq = n * L * H + i_h  # first query row of the block, in rows of [*, H]
    q += tq * K
    do += tq * V
    k += (w0 * H + i_h) * K
    v += (w0 * H + i_h) * V
    kvalid += w0
    cm += (n * H + i_h) * S * V
    logc += (n * H + i_h) * S
    cb += i_h * S * K
    pw += tq * W
    dsw += tq * W
    pc += tq * S
    dsc += tq * S
    b_q = tl.load(q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
    b_lse = tl.load(lse + tq + o_i * H, mask=m_i, other=0.0)
    b_d = tl.zeros([BM], tl.float32)  # rowsum(do o) (FlashAttention-2's D)
    for v0 in range(0, V, BV):
        o_v = v0 + o_bv
        m_dv = m_i[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + o_i[:, None] * (H * V) + o_v[None, :], mask=m_dv, other=0.0).to(tl.float32)
        b_d += tl.sum(b_do * tl.load(o + tq * V + o_i[:, None] * (H * V) + o_v[None, :], mask=m_dv, other=0.0), 1)
    b_dq = tl.zeros([BM, BK], tl.float32)
    hi = tl.minimum(W, L + i0 + BM)
    for j0 in range(0, hi, BN):
        o_j = j0 + o_n
        m_j = o_j < W
        ok = (tl.load(kvalid + o_j, mask=m_j, other=0) != 0) & m_j
        b_k = tl.load(k + o_j[:, None] * (H * K) + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        o_w = o_i[:, None] * (H * W) + o_j[None, :]
        m_w = m_i[:, None] & m_j[None, :]
        if HAS_BIAS:
            s += tl.load(bias + tq * W + o_w, mask=m_w, other=0.0).to(tl.float32)
        s = tl.where((o_j[None, :] <= L + o_i[:, None]) & ok[None, :], s, float("-inf"))
        p = tl.exp(s - b_lse[:, None])
        dp = tl.zeros([BM, BN], tl.float32)  # do . v^T over all of V
        for v0 in range(0, V, BV):
            o_v = v0 + o_bv
            b_do = tl.load(do + o_i[:, None] * (H * V) + o_v[None, :], mask=m_i[:, None] & (o_v < V)[None, :],
                           other=0.0)
            b_v = tl.load(v + o_j[:, None] * (H * V) + o_v[None, :], mask=ok[:, None] & (o_v < V)[None, :],
                          other=0.0)
            dp += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        ds = p * (dp - b_d[:, None])
        tl.store(pw + o_w, p.to(pw.dtype.element_ty), mask=m_w)
        tl.store(dsw + o_w, ds.to(dsw.dtype.element_ty), mask=m_w)
        b_dq += tl.dot(ds.to(DT), b_k, input_precision=PREC)
    zero = tl.zeros([BM, BN], tl.float32)
    for j0 in range(tl.cdiv(hi, BN) * BN, W, BN):  # beyond the causal limit
        o_j = j0 + o_n
        o_w = o_i[:, None] * (H * W) + o_j[None, :]
        m_w = m_i[:, None] & (o_j < W)[None, :]
        tl.store(pw + o_w, zero.to(pw.dtype.element_ty), mask=m_w)
        tl.store(dsw + o_w, zero.to(dsw.dtype.element_ty), mask=m_w)
    for c0 in range(0, S, BN):
        o_c = c0 + o_n
        m_c = o_c < S
        b_k = tl.load(cb + o_c[:, None] * K + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
        lc = tl.load(logc + o_c, mask=m_c, other=float("-inf"))
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) + lc[None, :]
        p = tl.exp(s - b_lse[:, None])
        dp = tl.zeros([BM, BN], tl.float32)
        for v0 in range(0, V, BV):
            o_v = v0 + o_bv
            b_do = tl.load(do + o_i[:, None] * (H * V) + o_v[None, :], mask=m_i[:, None] & (o_v < V)[None, :],
                           other=0.0)
            b_v = tl.load(cm + o_c[:, None] * V + o_v[None, :], mask=m_c[:, None] & (o_v < V)[None, :], other=0.0)
            dp += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        ds = p * (dp - b_d[:, None])
        o_s = o_i[:, None] * (H * S) + o_c[None, :]
        m_s = m_i[:, None] & m_c[None, :]
        tl.store(pc + o_s, p.to(pc.dtype.element_ty), mask=m_s)
        tl.store(dsc + o_s, ds.to(dsc.dtype.element_ty), mask=m_s)
        b_dq += tl.dot(ds.to(DT), b_k, input_precision=PREC)
    dq += tq * K
    tl.store(dq + o_i[:, None] * (H * K) + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_i[:, None] & m_k[None, :])


@triton.jit
def vq_bwd_key_kernel(
    a, x, qa, qb, out, L, NJT,
    H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):
    """Key side of the backward: for key rows ``j0 ..`` of flat block ``f``, ``out = A^T x`` over the queries
    that see them -- query block ``qa[f]`` (the block itself: window columns ``L + j``, rows ``i >= j``) and
    query block ``qb[f]`` (the next block: columns ``j``); ``-1`` = none.  ``A`` ``[NQ, L, H, 2L]`` (``P`` or
    ``dS`` of :func:`vq_bwd_query_kernel`), ``x`` ``[NQ, L, H, D]`` (``do`` or ``q``), ``out`` ``[NB, L, H, D]``
    (``dv`` or ``dk``), fp32 accumulation.  Grid ``(NB * NJT, cdiv(D, BD), H)``."""
    i_t, i_d, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    f = (i_t // NJT).to(tl.int64)
    j0 = (i_t % NJT) * BN
    W = 2 * L
    o_j = j0 + tl.arange(0, BN)
    m_j = o_j < L
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_bi = tl.arange(0, BI)
    acc = tl.zeros([BN, BD], tl.float32)
    na = tl.load(qa + f).to(tl.int64)
    nb = tl.load(qb + f).to(tl.int64)
    if na >= 0:
        a_n = a + (na * L * H + i_h) * W + L  # columns L + j of the block's own queries
        x_n = x + (na * L * H + i_h) * D
        for i_s in range((j0 // BI) * BI, L, BI):  # causal: rows below j0 never see these keys
            o_i = i_s + o_bi
            m_i = o_i < L
            b_a = tl.load(a_n + o_i[:, None] * (H * W) + o_j[None, :], mask=m_i[:, None] & m_j[None, :], other=0.0)
            b_x = tl.load(x_n + o_i[:, None] * (H * D) + o_d[None, :], mask=m_i[:, None] & m_d[None, :], other=0.0)
            acc += tl.dot(tl.trans(b_a), b_x, input_precision=PREC)
    if nb >= 0:
        a_n = a + (nb * L * H + i_h) * W  # columns j of the next block's queries
        x_n = x + (nb * L * H + i_h) * D
        for i_s in range(0, L, BI):
            o_i = i_s + o_bi
            m_i = o_i < L
            b_a = tl.load(a_n + o_i[:, None] * (H * W) + o_j[None, :], mask=m_i[:, None] & m_j[None, :], other=0.0)
            b_x = tl.load(x_n + o_i[:, None] * (H * D) + o_d[None, :], mask=m_i[:, None] & m_d[None, :], other=0.0)
            acc += tl.dot(tl.trans(b_a), b_x, input_precision=PREC)
    out += (f * L * H + i_h) * D
    tl.store(out + o_j[:, None] * (H * D) + o_d[None, :], acc.to(out.dtype.element_ty),
             mask=m_j[:, None] & m_d[None, :])
