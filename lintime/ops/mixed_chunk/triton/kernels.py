"""Triton kernel of the chunk-level linear state of mixed chunk attention (seed Eq. 8).

Notation: ``S`` key width, ``E`` value width, ``H`` heads, ``C`` chunk size; chunks are laid out
per sequence (every sequence starts a chunk, its last one may be short) and numbered
consecutively; a *segment* is a run of consecutive chunks of one sequence.  Tables: per chunk its
first token ``CH_START`` and length ``CH_LEN``; per segment its first chunk ``SEG_FIRST`` and
chunk count ``SEG_N``.

:func:`chunk_state_kernel` walks the chunks of one segment, carrying an ``[BS, BE]`` fp32 tile of
the state ``sum_c w_c X_c^T Y_c`` in registers:

* forward (``X = k_lin``, ``Y = v``, ``w_c`` = 1, or 0 for a short last chunk whose sum no later
  token sees), chunks in order;
* backward (``X = q_lin``, ``Y = do``, ``w_c`` = the chunk's normaliser ``1 / N``), chunks from
  last to first: the gradient flowing into each chunk's ``k_lin^T v`` from the queries of the
  later chunks.

With ``STORE_LOCAL`` it stores, for every chunk, the state *entering* it from inside its segment
(``LOC``, exclusive of the chunk itself); it always stores the segment's total (``TOT``, fp32).
``lintime.ops.triton_common.seg_scan_kernel`` then passes the totals along each sequence's
segments, so the state entering chunk ``c`` is ``start[seg(c)] + LOC[c]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_state_kernel(
    X, Y, LOC, TOT, W,
    SEG_FIRST, SEG_N, CH_START, CH_LEN,
    S, E, H,
    BS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    REVERSE: tl.constexpr, STORE_LOCAL: tl.constexpr, PREC: tl.constexpr,
):
    """Grid ``(S tiles * E tiles, segments, H)``."""
    i_se, i_g, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    for i in range(0, nc):
        if REVERSE:
            c = c0 + nc - 1 - i
        else:
            c = c0 + i
        if STORE_LOCAL:
            tl.store(LOC + (c.to(tl.int64) * H + i_h) * S * E + o_se, b_h.to(LOC.dtype.element_ty), mask=m_se)
        cs = tl.load(CH_START + c).to(tl.int64)
        cl = tl.load(CH_LEN + c)
        w = tl.load(W + c)
        b_d = tl.zeros([BS, BE], dtype=tl.float32)
        for t0 in range(0, cl, BT):
            m_t = (t0 + o_t) < cl
            rows = (cs + t0 + o_t) * H + i_h
            b_x = tl.load(X + rows[:, None] * S + o_s[None, :], mask=m_t[:, None] & m_s[None, :], other=0.0)
            b_y = tl.load(Y + rows[:, None] * E + o_e[None, :], mask=m_t[:, None] & m_e[None, :], other=0.0)
            b_d += tl.dot(tl.trans(b_x), b_y, input_precision=PREC)
        b_h += w * b_d
    tl.store(TOT + (i_g.to(tl.int64) * H + i_h) * S * E + o_se, b_h, mask=m_se)
