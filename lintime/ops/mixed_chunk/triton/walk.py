"""The state walks of mixed chunk attention (seed §3.2, Eq. 8): :func:`chunk_state_kernel` walks a segment's
chunks with an ``[S-tile, E-tile]`` fp32 state and writes the state entering every chunk (forward: ``k_lin, v``;
backward, in reverse: ``q_lin, do``), and :func:`seg_fix_kernel` adds each segment's start to its segment-local
states when sequences are cut into several segments.  Notation as in :mod:`.kernels`; the chunk and segment
tables: :func:`lintime.ops.utils.segments.chunk_plan`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lintime.ops.mixed_chunk.triton.kernels import _scores_tile


@triton.jit
def _walk_tile(X, Y, cs, t0, cl, o_t, o_s, o_e, m_s, m_e, S, E, H, i_h):
    """Masked ``[BT, BS]`` / ``[BT, BE]`` tiles of ``X`` / ``Y`` at tokens ``cs + t0 + o_t`` (< ``cl``)."""
    m_t = (t0 + o_t) < cl
    rows = (cs + t0 + o_t) * H + i_h
    b_x = tl.load(X + rows[:, None] * S + o_s[None, :], mask=m_t[:, None] & m_s[None, :], other=0.0)
    b_y = tl.load(Y + rows[:, None] * E + o_e[None, :], mask=m_t[:, None] & m_e[None, :], other=0.0)
    return b_x, b_y


@triton.jit
def chunk_state_kernel(
    X, Y, DX, DY, HOUT, TOT, INIT, W,
    SEG_FIRST, SEG_N, SEG_SEQ, CH_START, CH_LEN,
    S, E, H, NSEG, CHUNK,
    QQ, KQ, A, BIAS, scale, C, LB, NMT,
    BS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    REVERSE: tl.constexpr, STORE: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    FLAT: tl.constexpr, SCORES: tl.constexpr, BG: tl.constexpr, BSQ: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Walk the chunks of one segment (a run of chunks of one sequence), carrying an ``[BS, BE]``
    fp32 tile of ``sum_c w_c X_c^T Y_c`` in registers; one-dimensional grid, the first ``S tiles * E
    tiles * NSEG * H`` programs walk (tile fastest, then segment, then head).

    With ``SCORES`` (the forward) the programs after those compute the tiles of ``A``
    (:func:`_scores_tile` on ``QQ, KQ, A, BIAS, ...``, ``NC * NMT * NMT * H`` programs): independent of the
    walk, they fill the SMs the walk's last programs leave idle -- no launch of their own.

    Forward: ``X = k_lin, Y = v``, ``w_c = 1`` (0 for a short last chunk of a causal call: no later
    token sees it), chunks in order.  Reverse: ``X = q_lin, Y = do``, ``w_c`` = the chunk's
    ``1 / N``, chunks from last to first.  The walk starts from zero, or with ``HAS_INIT`` from its
    sequence's fp32 state in ``INIT [N, H, S, E]`` (one segment per sequence); with ``STORE`` it writes
    the state entering every chunk (``HOUT [NC, H, S, E]``: segment-local when the sequence has
    several segments, see :func:`seg_fix_kernel`); it always writes the state after the segment
    (``TOT``).

    With ``TMA`` the whole ``BT``-token steps of a chunk load ``X`` and ``Y`` through the tensor
    descriptors ``DX`` / ``DY`` (:func:`lintime.ops.utils.tma.tma_descriptors`); a short
    chunk's partial last step uses masked loads (its rows past the chunk are the next chunk's).
    """
    pid = tl.program_id(0)
    NE = tl.cdiv(E, BE)
    NSE = tl.cdiv(S, BS) * NE
    nwalk = NSE * NSEG * H
    if SCORES:
        if pid >= nwalk:
            p = pid - nwalk
            _scores_tile(QQ, KQ, A, BIAS, CH_START, CH_LEN, p % (NMT * NMT) // NMT, p % NMT, p // (NMT * NMT) % H,
                         p // (NMT * NMT * H), scale, S, H, C, LB, BG, BSQ, CAUSAL, HAS_BIAS, PREC)
        else:
            _walk_segment(X, Y, DX, DY, HOUT, TOT, INIT, W, SEG_FIRST, SEG_N, SEG_SEQ, CH_START, CH_LEN,
                          pid % NSE, pid // NSE % NSEG, pid // (NSE * NSEG), S, E, H, CHUNK,
                          BS, BE, BT, REVERSE, STORE, HAS_INIT, PREC, TMA, FLAT)
    else:
        _walk_segment(X, Y, DX, DY, HOUT, TOT, INIT, W, SEG_FIRST, SEG_N, SEG_SEQ, CH_START, CH_LEN,
                      pid % NSE, pid // NSE % NSEG, pid // (NSE * NSEG), S, E, H, CHUNK,
                      BS, BE, BT, REVERSE, STORE, HAS_INIT, PREC, TMA, FLAT)


@triton.jit
def _walk_segment(
    X, Y, DX, DY, HOUT, TOT, INIT, W, SEG_FIRST, SEG_N, SEG_SEQ, CH_START, CH_LEN, i_se, i_g, i_h, S, E, H, CHUNK,
    BS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    REVERSE: tl.constexpr, STORE: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    FLAT: tl.constexpr,
):
    """:func:`chunk_state_kernel`'s walk of segment ``i_g``, state tile ``i_se``, head ``i_h`` (a segment of no
    chunks -- an empty sequence, or a static plan's slack row -- leaves its start state in ``TOT``).

    ``FLAT`` (chunks of ``CHUNK`` tokens, a whole number of ``BT``-token steps): the segment's full chunks --
    consecutive tokens -- are walked as one loop over their token steps, so the loads of the next chunk are in
    flight while a chunk ends (its state added and stored); a short last chunk of the sequence is walked on its
    own (first in reverse, last forward).  Otherwise one loop per chunk (:func:`_walk_chunk`)."""
    NE = tl.cdiv(E, BE)
    i_s, i_e = i_se // NE, i_se % NE
    o_s = i_s * BS + tl.arange(0, BS)
    o_e = i_e * BE + tl.arange(0, BE)
    m_s = o_s < S
    m_e = o_e < E
    o_t = tl.arange(0, BT)
    o_se = o_s[:, None] * E + o_e[None, :]
    m_se = m_s[:, None] & m_e[None, :]
    c0 = tl.load(SEG_FIRST + i_g)
    nc = tl.load(SEG_N + i_g)
    b_h = tl.zeros([BS, BE], dtype=tl.float32)
    if HAS_INIT:
        i_n = tl.load(SEG_SEQ + i_g).to(tl.int64)
        b_h += tl.load(INIT + (i_n * H + i_h) * S * E + o_se, mask=m_se, other=0.0)
    if FLAT:
        c_end = c0 + nc - 1
        # (a segment of no chunks, an empty sequence's, reads no table entry: c_end is then outside its sequence)
        short = tl.load(CH_LEN + c_end, mask=nc > 0, other=CHUNK) < CHUNK
        nfull = nc - short.to(tl.int32)
        if REVERSE:
            if short:
                b_h = _walk_chunk(X, Y, DX, DY, HOUT, W, CH_START, CH_LEN, c_end, b_h, o_t, o_s, o_e, m_s, m_e,
                                  o_se, m_se, i_s, i_e, i_h, S, E, H, BS, BE, BT, STORE, PREC, TMA)
        spc = CHUNK // BT
        cs0 = tl.load(CH_START + c0, mask=nc > 0, other=0).to(tl.int64)
        b_d = tl.zeros([BS, BE], dtype=tl.float32)
        for i in range(nfull * spc):
            j = i // spc
            r = i - j * spc
            if REVERSE:
                j = nfull - 1 - j
            c = c0 + j
            if STORE:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
                if r == 0:
                    tl.store(HOUT + (c.to(tl.int64) * H + i_h) * S * E + o_se, b_h.to(HOUT.dtype.element_ty),
                             mask=m_se)
            t = cs0 + j * CHUNK + r * BT
            if TMA:
                b_x = DX.load([t.to(tl.int32), i_h * S + i_s * BS])
                b_y = DY.load([t.to(tl.int32), i_h * E + i_e * BE])
            else:
                b_x, b_y = _walk_tile(X, Y, t, 0, BT, o_t, o_s, o_e, m_s, m_e, S, E, H, i_h)
            if REVERSE:  # per-chunk weights: the chunk's partial sum is added with its weight at its last step --
                # without a branch (one around the accumulator keeps the MMA out of the pipeline)
                b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
                end = r == spc - 1
                b_h += tl.where(end, tl.load(W + c), 0.0) * b_d
                b_d = tl.where(end, 0.0, b_d)
            else:  # forward walks weigh every full chunk 1 (``wf``): straight into the state
                b_h = tl.dot(tl.trans(b_x), b_y, b_h, input_precision=PREC)
        if not REVERSE:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
            if short:
                b_h = _walk_chunk(X, Y, DX, DY, HOUT, W, CH_START, CH_LEN, c_end, b_h, o_t, o_s, o_e, m_s, m_e,
                                  o_se, m_se, i_s, i_e, i_h, S, E, H, BS, BE, BT, STORE, PREC, TMA)
    else:
        for i in range(nc):
            if REVERSE:
                c = c0 + nc - 1 - i
            else:
                c = c0 + i
            b_h = _walk_chunk(X, Y, DX, DY, HOUT, W, CH_START, CH_LEN, c, b_h, o_t, o_s, o_e, m_s, m_e,
                              o_se, m_se, i_s, i_e, i_h, S, E, H, BS, BE, BT, STORE, PREC, TMA)
    tl.store(TOT + (i_g.to(tl.int64) * H + i_h) * S * E + o_se, b_h, mask=m_se)


@triton.jit
def _walk_chunk(
    X, Y, DX, DY, HOUT, W, CH_START, CH_LEN, c, b_h, o_t, o_s, o_e, m_s, m_e, o_se, m_se, i_s, i_e, i_h, S, E, H,
    BS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    STORE: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
):
    """One chunk ``c`` of a walk: store the state entering it (``STORE``), return it plus ``w_c X_c^T Y_c``."""
    if STORE:
        tl.store(HOUT + (c.to(tl.int64) * H + i_h) * S * E + o_se, b_h.to(HOUT.dtype.element_ty), mask=m_se)
    cs = tl.load(CH_START + c).to(tl.int64)
    cl = tl.load(CH_LEN + c)
    w = tl.load(W + c)
    b_d = tl.zeros([BS, BE], dtype=tl.float32)
    if TMA:
        full = (cl // BT) * BT
        for t0 in range(0, full, BT):
            r = (cs + t0).to(tl.int32)
            b_x = DX.load([r, i_h * S + i_s * BS])
            b_y = DY.load([r, i_h * E + i_e * BE])
            b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
        if full < cl:  # a short chunk's partial last step: one masked step, not a second pipelined loop
            b_x, b_y = _walk_tile(X, Y, cs, full, cl, o_t, o_s, o_e, m_s, m_e, S, E, H, i_h)
            b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
    else:
        for t0 in range(0, cl, BT):
            b_x, b_y = _walk_tile(X, Y, cs, t0, cl, o_t, o_s, o_e, m_s, m_e, S, E, H, i_h)
            b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
    return b_h + w * b_d


@triton.jit
def seg_fix_kernel(
    HOUT, TOT, INIT, FINAL, SEG_FIRST, SEG_N, SEG_SEQ, SEQ_PTR,
    S, E, H,
    BS: tl.constexpr, BE: tl.constexpr, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr,
):
    """Turn segment-local per-chunk states into global ones: ``HOUT[c] += start(segment)``, where
    ``start`` = the initial state + the totals of the sequence's segments walked before this one;
    the last segment (in walk order) also writes the sequence's final state.  With the walk from
    zero at every segment (``chunk_state_kernel`` with ``STORE``) this gives the states entering every
    chunk in two passes.  Grid ``(S tiles * E tiles, segment rows, H)``: rows past ``SEQ_PTR[N]`` (a static
    plan's slack, its ``SEG_SEQ`` the last sequence) hold no segment and do nothing.  Bound by its memory traffic
    (every state but the first segment's read and written)."""
    i_se, i_g, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NE = tl.cdiv(E, BE)
    i_s, i_e = i_se // NE, i_se % NE
    o_s = i_s * BS + tl.arange(0, BS)
    o_e = i_e * BE + tl.arange(0, BE)
    o_se = o_s[:, None] * E + o_e[None, :]
    m_se = (o_s < S)[:, None] & (o_e < E)[None, :]
    i_n = tl.load(SEG_SEQ + i_g)
    g0 = tl.load(SEQ_PTR + i_n)
    g1 = tl.load(SEQ_PTR + i_n + 1)
    if i_g >= g1:
        return
    b_st = tl.zeros([BS, BE], dtype=tl.float32)
    if HAS_INIT:
        b_st += tl.load(INIT + (i_n.to(tl.int64) * H + i_h) * S * E + o_se, mask=m_se, other=0.0)
    if REVERSE:  # segments after this one come first in the walk
        lo = i_g + 1
        hi = g1
    else:
        lo = g0
        hi = i_g
    for g in range(lo, hi):
        b_st += tl.load(TOT + (g * H + i_h).to(tl.int64) * S * E + o_se, mask=m_se, other=0.0)
    if HAS_INIT or hi > lo:
        c0 = tl.load(SEG_FIRST + i_g)
        nc = tl.load(SEG_N + i_g)
        for i in range(nc):
            p = HOUT + ((c0 + i).to(tl.int64) * H + i_h) * S * E + o_se
            b_h = tl.load(p, mask=m_se, other=0.0).to(tl.float32)
            tl.store(p, (b_h + b_st).to(HOUT.dtype.element_ty), mask=m_se)
    if REVERSE:
        last = i_g == g0
    else:
        last = i_g == g1 - 1
    if last:
        b_tot = tl.load(TOT + (i_g.to(tl.int64) * H + i_h) * S * E + o_se, mask=m_se, other=0.0)
        tl.store(FINAL + (i_n.to(tl.int64) * H + i_h) * S * E + o_se, b_st + b_tot, mask=m_se)
