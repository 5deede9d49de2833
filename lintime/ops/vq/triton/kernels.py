"""Triton kernels of Transformer-VQ attention (seed Theorem 3.7, Remark 3.9, Appendix E Code 1).

Notation: ``L`` block length, ``S`` codes, ``K`` key width, ``V`` value width, ``H`` heads, ``NQ``
query blocks, ``NB`` blocks of the layout (``R * NE``, :mod:`lintime.ops.vq.chunk`), ``W = 2L``
window columns.  Every tensor is in the block layout of the chunked form:

* ``q`` ``[NQ, L, H, K]`` the queries of each query block (zero in empty slots);
* ``k``, ``v`` ``[NB, L, H, K / V]`` the keys / values of every block, ``kvalid`` ``[NB, L]`` int8;
  query block ``n`` sits at flat block ``qblk[n]``; its window is blocks ``qblk[n] - 1`` (window
  columns ``[0, L)``) and ``qblk[n]`` (columns ``[L, 2L)``): ``2L`` contiguous key slots;
* ``bias`` ``[NQ, L, H, W]`` window bias by column;
* ``cb`` ``[H, S, K]`` the codebook (keys of the cache, shared by every block), ``logc`` ``[NQ, H, S]``
  ``log(count)`` of the cache of each query block (``-inf`` for an empty code), ``cm`` ``[NQ, H, S, V]``
  its per-code mean values;
* ``pw`` / ``pc`` ``[NQ, L, H, W]`` / ``[NQ, L, H, S]`` the probabilities of the window columns / cache codes
  (``dsw`` / ``dsc`` their score gradients), zero where a row does not see the column;
* ``pvalid`` ``[NQ]`` int8: whether query block ``n``'s previous block holds a key (a sequence's first block has
  none: its window columns ``[0, L)`` are skipped, their probabilities and score gradients written as zeros);
* ``o`` ``[NQ, L, H, V]``, ``delta`` ``[NQ, L, H]`` fp32.

A query row ``i`` of block ``n`` sees window column ``j`` when ``j <= L + i`` and the key slot holds a
key, and every code of its cache (seed Eq. 28-33); one log-sum-exp covers both (Code 1).

The scores are ``[L, 2L + S]`` per query block (the chunked form's size, never ``T x T``), so the kernels write
the probabilities once and run the two ``V``-wide products -- ``o = P [v; mean]`` forward, ``dP = do [v; mean]^T``
backward -- as tiled matrix products over them (:func:`vq_pv_kernel`, :func:`vq_dp_kernel`) instead of
recomputing the scores per value tile inside an online softmax.
"""

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # running-max start: finite, so a tile with every score masked (-inf) leaves it unchanged


@triton.jit
def _query_tile(i_t, i_h, NQT, L, H: tl.constexpr, BM: tl.constexpr):
    """Program ``i_t``'s query block ``n`` (int64), its tile's first row ``i0``, rows ``o_i`` (mask ``m_i``) and the
    block's first query row ``tq`` in rows of ``[*, H]``."""
    n = (i_t // NQT).to(tl.int64)
    i0 = (i_t % NQT) * BM
    o_i = i0 + tl.arange(0, BM)
    return n, i0, o_i, o_i < L, n * L * H + i_h


@triton.jit
def _window_span(pvalid, n, i0, L, BM: tl.constexpr, B: tl.constexpr):
    """``(lo, hi)``: the window columns query tile ``i0`` of block ``n`` walks in steps of ``B`` -- up to its causal
    limit (no row of the tile sees a column ``>= L + i0 + BM``), from the block boundary's step when the previous
    block holds no key (``pvalid[n] == 0``: those columns are masked)."""
    return tl.where(tl.load(pvalid + n) != 0, 0, (L // B) * B), tl.minimum(2 * L, L + i0 + BM)


@triton.jit
def _window_scores(b_q, k, kvalid, bias_rows, o_i, m_i, o_j, o_k, m_k, L, TB, H: tl.constexpr, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, REL: tl.constexpr, PREC: tl.constexpr):
    """Scores ``[BM, BN]`` of the query tile against window columns ``o_j`` (bias added, causal limit and empty
    slots ``-inf``); ``k`` / ``kvalid`` point at the window's first slot, ``bias_rows`` at the block's bias row 0:
    the window bias (``TB = 2L`` columns a row), or with ``REL`` the relative table (``TB`` columns a row, column
    ``c`` of row ``a`` at ``c - a`` for ``0 <= c - a <= L``, zero elsewhere)."""
    m_j = o_j < 2 * L
    ok = (tl.load(kvalid + o_j, mask=m_j, other=0) != 0) & m_j
    b_k = tl.load(k + o_j[:, None] * (H * K) + o_k[None, :], mask=m_j[:, None] & m_k[None, :], other=0.0)
    s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    if HAS_BIAS:
        if REL:
            t = o_j[None, :] - o_i[:, None]
            s += tl.load(bias_rows + o_i[:, None] * (H * TB) + t, mask=m_i[:, None] & (t >= 0) & (t <= L),
                         other=0.0).to(tl.float32)
        else:
            s += tl.load(bias_rows + o_i[:, None] * (H * TB) + o_j[None, :], mask=m_i[:, None] & m_j[None, :],
                         other=0.0).to(tl.float32)
    return tl.where((o_j[None, :] <= L + o_i[:, None]) & ok[None, :], s, float("-inf"))


@triton.jit
def _code_scores(b_q, cb, logc, o_c, o_k, m_k, S, K: tl.constexpr, PREC: tl.constexpr):
    """Scores ``[BM, BN]`` of the query tile against cache codes ``o_c``: ``q . codebook + log count``."""
    m_c = o_c < S
    b_k = tl.load(cb + o_c[:, None] * K + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
    lc = tl.load(logc + o_c, mask=m_c, other=float("-inf"))
    return tl.dot(b_q, tl.trans(b_k), input_precision=PREC) + lc[None, :]


@triton.jit
def vq_probs_kernel(
    q, k, kvalid, qblk, pvalid, bias, cb, logc, pw, pc,
    L, S, NQT, TB,
    H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, REL: tl.constexpr, PREC: tl.constexpr,
):
    """The probabilities of query rows ``i0 ..`` of one query block: a first pass over the window columns (up to
    the tile's causal limit) and the cache codes takes the row max and sum (online, fp32), a second recomputes the
    scores and writes ``P = exp(s - lse)`` into ``pw`` / ``pc`` in their dtype, zeros past the causal limit.
    Grid ``(NQ * NQT, H)``."""
    i_h = tl.program_id(1)
    n, i0, o_i, m_i, tq = _query_tile(tl.program_id(0), i_h, NQT, L, H, BM)
    w0 = (tl.load(qblk + n).to(tl.int64) - 1) * L  # first key slot of the window
    W = 2 * L
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, BN)
    q += tq * K
    k += (w0 * H + i_h) * K
    kvalid += w0
    if HAS_BIAS:
        bias += tq * TB
    logc += (n * H + i_h) * S
    cb += i_h * S * K
    b_q = tl.load(q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)
    b_m = tl.full([BM], NEG, tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    lo, hi = _window_span(pvalid, n, i0, L, BM, BN)
    for j0 in range(lo, hi, BN):
        s = _window_scores(b_q, k, kvalid, bias, o_i, m_i, j0 + o_n, o_k, m_k, L, TB, H, K, HAS_BIAS, REL,
                               PREC)
        m_new = tl.maximum(b_m, tl.max(s, 1))
        b_l = b_l * tl.exp(b_m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        b_m = m_new
    for c0 in range(0, S, BN):
        s = _code_scores(b_q, cb, logc, c0 + o_n, o_k, m_k, S, K, PREC)
        m_new = tl.maximum(b_m, tl.max(s, 1))
        b_l = b_l * tl.exp(b_m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        b_m = m_new
    lse = b_m + tl.log(tl.where(b_l > 0, b_l, 1.0))  # a row that sees nothing: every p = exp(-inf) = 0
    pw += tq * W
    pc += tq * S
    for j0 in range(0, W, BN):
        o_j = j0 + o_n
        m_w = m_i[:, None] & (o_j < W)[None, :]
        if (j0 >= lo) & (j0 < hi):
            s = _window_scores(b_q, k, kvalid, bias, o_i, m_i, o_j, o_k, m_k, L, TB, H, K, HAS_BIAS, REL,
                               PREC)
            p = tl.exp(s - lse[:, None])
        else:
            p = tl.zeros([BM, BN], tl.float32)
        tl.store(pw + o_i[:, None] * (H * W) + o_j[None, :], p.to(pw.dtype.element_ty), mask=m_w)
    for c0 in range(0, S, BN):
        o_c = c0 + o_n
        p = tl.exp(_code_scores(b_q, cb, logc, o_c, o_k, m_k, S, K, PREC) - lse[:, None])
        tl.store(pc + o_i[:, None] * (H * S) + o_c[None, :], p.to(pc.dtype.element_ty),
                 mask=m_i[:, None] & (o_c < S)[None, :])


@triton.jit
def vq_pv_kernel(
    aw, ac, x, y, qblk, pvalid, out,
    L, S, NQT, YB,
    H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """``out = A [x_window; y]`` for query rows ``i0 ..`` of one query block and one ``BD``-wide column tile:
    ``A`` is ``aw`` (window columns, their rows of ``x [NB, L, H, D]``, up to the tile's causal limit) then ``ac``
    (codes, the rows of ``y [.., H, S, D]`` at block stride ``YB`` -- 0 for the shared codebook), fp32
    accumulation, one rounding.  Forward ``o = P [v; mean]``; backward ``dq = dS [k; codebook]``.
    Grid ``(NQ * NQT, cdiv(D, BD), H)``."""
    i_d, i_h = tl.program_id(1), tl.program_id(2)
    n, i0, o_i, m_i, tq = _query_tile(tl.program_id(0), i_h, NQT, L, H, BM)
    w0 = (tl.load(qblk + n).to(tl.int64) - 1) * L
    W = 2 * L
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_b = tl.arange(0, BK)
    aw += tq * W
    ac += tq * S
    x += (w0 * H + i_h) * D
    y += n * YB + i_h * S * D
    acc = tl.zeros([BM, BD], tl.float32)
    lo, hi = _window_span(pvalid, n, i0, L, BM, BK)  # A is zero before lo and past hi
    for j0 in range(lo, hi, BK):
        o_j = j0 + o_b
        m_j = o_j < W
        b_a = tl.load(aw + o_i[:, None] * (H * W) + o_j[None, :], mask=m_i[:, None] & m_j[None, :], other=0.0)
        b_x = tl.load(x + o_j[:, None] * (H * D) + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
        acc += tl.dot(b_a, b_x, input_precision=PREC)
    for c0 in range(0, S, BK):
        o_c = c0 + o_b
        m_c = o_c < S
        b_a = tl.load(ac + o_i[:, None] * (H * S) + o_c[None, :], mask=m_i[:, None] & m_c[None, :], other=0.0)
        b_y = tl.load(y + o_c[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.0)
        acc += tl.dot(b_a, b_y, input_precision=PREC)
    out += tq * D
    tl.store(out + o_i[:, None] * (H * D) + o_d[None, :], acc.to(out.dtype.element_ty),
             mask=m_i[:, None] & m_d[None, :])


@triton.jit
def _do_xt(do, xr, x_stride, o_i, m_i, o_j, m_j, D: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """``do . x^T`` ``[BM, BN]`` over all ``D`` columns, fp32: ``do`` at the tile's row 0 (row stride ``H * D``),
    ``xr`` at row 0 of the column rows (row stride ``x_stride``)."""
    o_b = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for d0 in range(0, D, BK):
        o_d = d0 + o_b
        m_d = o_d < D
        b_do = tl.load(do + o_i[:, None] * (H * D) + o_d[None, :], mask=m_i[:, None] & m_d[None, :], other=0.0)
        b_x = tl.load(xr + o_j[:, None] * x_stride + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
        acc += tl.dot(b_do, tl.trans(b_x), input_precision=PREC)
    return acc


@triton.jit
def vq_dp_kernel(
    do, x, y, qblk, pvalid, pw, pc, delta, dsw, dsc,
    L, S, NQT, NWT, YB,
    H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Score gradients of query rows ``i0 ..`` of one query block and one ``BN``-wide column tile:
    ``dS = P (do . x^T - delta)`` with ``delta = rowsum(do o)`` (FlashAttention-2's ``D``), fp32 ``do . x^T`` over
    all of ``D`` (``V``).  Column tiles ``0 .. NWT - 1`` are window columns (``x`` = the window's values, rows of
    ``[NB, L, H, D]``; tiles past the query tile's causal limit, and tiles of an empty previous block, are written
    as zeros), the rest cache codes (``x``
    = the block's per-code means ``y``, block stride ``YB``).  ``P`` is read from ``pw`` / ``pc`` (the forward's).
    Grid ``(NQ * NQT, NWT + cdiv(S, BN), H)``."""
    i_c, i_h = tl.program_id(1), tl.program_id(2)
    n, i0, o_i, m_i, tq = _query_tile(tl.program_id(0), i_h, NQT, L, H, BM)
    W = 2 * L
    o_n = tl.arange(0, BN)
    do += tq * D
    b_delta = tl.load(delta + tq + o_i * H, mask=m_i, other=0.0)
    if i_c < NWT:
        o_j = i_c * BN + o_n
        m_w = m_i[:, None] & (o_j < W)[None, :]
        o_w = tq * W + o_i[:, None] * (H * W) + o_j[None, :]
        lo, hi = _window_span(pvalid, n, i0, L, BM, BN)
        if (i_c * BN >= lo) & (i_c * BN < hi):
            w0 = (tl.load(qblk + n).to(tl.int64) - 1) * L
            dp = _do_xt(do, x + (w0 * H + i_h) * D, H * D, o_i, m_i, o_j, o_j < W, D, H, BM, BN, BK, PREC)
            p = tl.load(pw + o_w, mask=m_w, other=0.0).to(tl.float32)
            ds = p * (dp - b_delta[:, None])
        else:
            ds = tl.zeros([BM, BN], tl.float32)
        tl.store(dsw + o_w, ds.to(dsw.dtype.element_ty), mask=m_w)
    else:
        o_c = (i_c - NWT) * BN + o_n
        m_c = o_c < S
        dp = _do_xt(do, y + n * YB + i_h * S * D, D, o_i, m_i, o_c, m_c, D, H, BM, BN, BK, PREC)
        o_s = tq * S + o_i[:, None] * (H * S) + o_c[None, :]
        m_s = m_i[:, None] & m_c[None, :]
        p = tl.load(pc + o_s, mask=m_s, other=0.0).to(tl.float32)
        tl.store(dsc + o_s, (p * (dp - b_delta[:, None])).to(dsc.dtype.element_ty), mask=m_s)


@triton.jit
def vq_rel_grad_kernel(dsw, dtab, R, L, TB, H: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr):
    """The relative table's gradient from the window's: ``dtab[r, t] = dsw[r, a + t]`` for ``t <= L`` (row ``r`` of
    ``[NQ * L * H]`` at offset ``a = (r // H) % L`` in its block), 0 for the alignment columns ``L < t < TB``.
    Grid ``(cdiv(R, BR), cdiv(TB, BT))``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_t = tl.program_id(1) * BT + tl.arange(0, BT)
    m_r = o_r < R
    a = (o_r // H) % L
    m = m_r[:, None] & (o_t <= L)[None, :]
    g = tl.load(dsw + o_r[:, None] * (2 * L) + a[:, None] + o_t[None, :], mask=m, other=0.0)
    tl.store(dtab + o_r[:, None] * TB + o_t[None, :], g, mask=m_r[:, None] & (o_t < TB)[None, :])


@triton.jit
def vq_delta_kernel(do, o, delta, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``delta = rowsum(do o)`` in fp32 for ``R`` rows of ``D``.  Grid ``(cdiv(R, BR),)``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    acc = tl.zeros([BR], tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m = m_r[:, None] & (o_d < D)[None, :]
        off = o_r[:, None] * D + o_d[None, :]
        acc += tl.sum(tl.load(do + off, mask=m, other=0.0).to(tl.float32)
                      * tl.load(o + off, mask=m, other=0.0).to(tl.float32), 1)
    tl.store(delta + o_r, acc, mask=m_r)


@triton.jit
def vq_bwd_key_kernel(
    a, x, qa, qb, out, L, NJT,
    H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):
    """Key side of the backward: for key rows ``j0 ..`` of flat block ``f``, ``out = A^T x`` over the queries
    that see them -- query block ``qa[f]`` (the block itself: window columns ``L + j``, rows ``i >= j``) and
    query block ``qb[f]`` (the next block: columns ``j``); ``-1`` = none.  ``A`` ``[NQ, L, H, 2L]`` (``P`` or
    ``dS``), ``x`` ``[NQ, L, H, D]`` (``do`` or ``q``), ``out`` ``[NB, L, H, D]``
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
