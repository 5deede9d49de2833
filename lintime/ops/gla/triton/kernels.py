"""Triton kernels of gated linear attention (SPEC 2.5; seed §4.2-4.3).

Notation: flat token-major ``q, k, g [TT, H, K]``, ``v, o [TT, H, V]``; inside a chunk of ``BT``
tokens ``G_i`` = in-chunk cumulative log-gate (fp32, computed in the kernel with ``tl.cumsum``;
no ``G`` tensor is written), ``G_l`` = its last value; ``h_n`` = state entering chunk ``n``,
``[K, V]`` fp32.  Chunkwise form (seed §4.2)::

    A_ij  = scale * sum_k q_ik k_jk exp(G_ik - G_jk),  j <= i          (gla_fwd_A_kernel)
    o_i   = scale * (q_i * exp(G_i)) h_n + sum_j A_ij v_j              (gla_fwd_kernel, a walk)
    h_n+1 = exp(G_l) * h_n + (k * exp(G_l - G))^T v

``A`` uses the secondary tiling of :mod:`lintime.ops.triton_common` (inter-sub-chunk half
precision matmuls, intra-sub-chunk fp32 log space) and is computed once per chunk and kept
(fp32, ``[TT, H, BT]``) for the output walk and the backward.

Backward (seed §4.3), ``dh_n`` = gradient of the state after chunk ``n``::

    dh_n-1 = exp(G_l) dh_n + scale * (q * exp(G))^T do
    dv_j   = sum_i A_ij do_i + (k_j * exp(G_l - G_j)) dh_n                  (gla_bwd_dv_kernel, walks
                                                                              backward, writes dh_n)
    dA_ij  = scale * do_i . v_j                                             (gla_bwd_dqkg_kernel,
    dq_i   = scale * exp(G_i) (do_i h_n^T) + sum_{j<=i} dA_ij k_j exp(G_i - G_j)    walks forward)
    dk_j   = exp(G_l - G_j) (v_j dh_n^T) + sum_{i>=j} dA_ij q_i exp(G_i - G_j)
    dg_t   = sum_{i >= t in chunk} (q_i dq_i - k_i dk_i) + sum_v (dh_n * h_n+1)      (closed form)

The gate gradient needs the forward state and its gradient of the same chunk: the forward walk
carries ``h`` in registers and reads ``dh_n`` written by the backward walk (one materialised
state per chunk, in bf16 for bf16 inputs), never per-step states.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lintime.ops.triton_common import (
    segment_bounds,
    subchunk_A,
    subchunk_dqdk,
    subchunk_stats,
)


@triton.jit
def gla_fwd_A_kernel(
    q, k, g, A, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
):
    """The in-chunk score block ``A [BT, BT]`` of one chunk (layout: one segment per chunk), summed
    over K-blocks of ``BK`` (every factor is per feature); grid ``(NCH, H)``.  Row ``t`` of ``A``
    holds the scores of token ``t`` against its chunk."""
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    bos, eos, _, _ = segment_bounds(seg, i_c, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_t = bos + tl.arange(0, BT)
    m_t = o_t < eos
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p = (o_t * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p, mask=m_tk, other=0.).to(tl.float32)
        b_gcs, b_M, b_tot = subchunk_stats(tl.load(g + p, mask=m_tk, other=0.).to(tl.float32), BT, BC, BK)
        b_A += subchunk_A(b_q, b_k, b_gcs, b_M, b_tot, k + i_h * K, g + i_h * K, bos, eos, o_k, m_k, H * K, BT, BC,
                          DT, PREC)
    o_c = tl.arange(0, BT)
    tl.store(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], b_A * scale, mask=m_t[:, None])


@triton.jit
def gla_fwd_kernel(
    q, k, v, g, A, o, h0, hs, ht, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, MAT: tl.constexpr, DT: tl.constexpr, SDT: tl.constexpr,
    PREC: tl.constexpr,
):
    """Output of one segment, V-block ``i_v`` (all of K in the tile); the state walks the
    segment's chunks in registers.  Grid ``(NV * NSEG, H)``."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s, i_v = i_p // NV, i_p % NV
    bos, eos, i_n, _ = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if MAT:
        b_h += tl.load(hs + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    elif HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    o_c = tl.arange(0, BT)
    for c in range(tl.cdiv(eos - bos, BT)):
        o_t = bos + c * BT + o_c
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_k = (o_t * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_k, mask=m_tk, other=0.)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.)
        b_g = tl.load(g + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_v = tl.load(v + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_A = tl.load(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.)
        b_G = tl.cumsum(b_g, 0)  # decay from the chunk start to row i (inclusive)
        b_Gr = tl.cumsum(b_g, 0, reverse=True) - b_g  # decay from row j (exclusive) to the chunk end
        b_gl = tl.sum(b_g, 0)
        # inter-chunk: queries read the incoming state through their decay from the chunk start
        b_o = tl.dot((b_q.to(tl.float32) * tl.exp(b_G)).to(SDT), b_h.to(SDT), input_precision=PREC) * scale
        b_o = tl.dot(b_A.to(DT), b_v.to(DT), b_o, input_precision=PREC)
        tl.store(o + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        # seed Eq. 2 (chunk recurrence), every exponent <= 0
        b_kd = (b_k.to(tl.float32) * tl.exp(b_Gr)).to(DT)
        b_h = tl.dot(tl.trans(b_kd), b_v.to(DT), b_h * tl.exp(b_gl)[:, None], input_precision=PREC)
    if not MAT:
        tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)


@triton.jit
def gla_bwd_dv_kernel(
    q, k, g, A, do, dv, dht, dh0, ds, dhs, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, MAT: tl.constexpr, STORE_DH0: tl.constexpr,
    DT: tl.constexpr, SDT: tl.constexpr, PREC: tl.constexpr,
):
    """``dv`` of one segment, V-block ``i_v`` (all of K): backward walk carrying the state
    gradient, which it also writes per chunk (``dhs [NCH, H, K, V]``, gradient of the state after
    the chunk) for :func:`gla_bwd_dqkg_kernel`.  Grid ``(NV * NSEG, H)``."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s, i_v = i_p // NV, i_p % NV
    bos, eos, i_n, ch0 = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if MAT:
        b_dh += tl.load(ds + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    elif HAS_DHT:
        b_dh += tl.load(dht + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    o_c = tl.arange(0, BT)
    n_c = tl.cdiv(eos - bos, BT)
    for c in range(n_c):
        i_c = n_c - 1 - c
        o_t = bos + i_c * BT + o_c
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(dhs + ((ch0 + i_c) * H + i_h) * K * V + o_kv, b_dh.to(dhs.dtype.element_ty), mask=m_kv)
        p_k = (o_t * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_k, mask=m_tk, other=0.)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.)
        b_g = tl.load(g + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_do = tl.load(do + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_A = tl.load(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.)
        b_G = tl.cumsum(b_g, 0)
        b_gl = tl.sum(b_g, 0)
        b_kd = b_k.to(tl.float32) * tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)
        b_dv = tl.dot(b_kd.to(SDT), b_dh.to(SDT), input_precision=PREC)
        b_dv = tl.dot(tl.trans(b_A).to(DT), b_do.to(DT), b_dv, input_precision=PREC)
        tl.store(dv + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_qd = (b_q.to(tl.float32) * tl.exp(b_G)).to(DT)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + scale * tl.dot(tl.trans(b_qd), b_do.to(DT), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + o_kv, b_dh, mask=m_kv)


@triton.jit
def gla_bwd_dqkg_kernel(
    q, k, v, g, do, dq, dk, dg, h0, hs, dhs, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr, MAT: tl.constexpr, DT: tl.constexpr,
    SDT: tl.constexpr, PREC: tl.constexpr,
):
    """``dq, dk, dg`` of one segment, K-block ``i_k`` (all of V): forward walk carrying the
    forward state, reading each chunk's state gradient from ``dhs``.  Grid ``(NK * NSEG, H)``."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s, i_k = i_p // NK, i_p % NK
    bos, eos, i_n, ch0 = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if MAT:
        b_h += tl.load(hs + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    elif HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    o_c = tl.arange(0, BT)
    m_causal = o_c[:, None] >= o_c[None, :]
    for c in range(tl.cdiv(eos - bos, BT)):
        t0 = bos + c * BT
        o_t = t0 + o_c
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_k = (o_t * H + i_h)[:, None] * K + o_k[None, :]
        p_v = (o_t * H + i_h)[:, None] * V + o_v[None, :]
        b_q = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_g = tl.load(g + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.)
        b_dh = tl.load(dhs + ((ch0 + c) * H + i_h) * K * V + o_kv, mask=m_kv, other=0.).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)
        b_gl = tl.sum(b_g, 0)
        b_kd = tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)  # exp(G_last - G_j)
        b_dA = tl.dot(b_do.to(DT), tl.trans(b_v.to(DT)), input_precision=PREC)
        b_dA = tl.where(m_causal, b_dA * scale, 0.)
        b_dq = tl.dot(b_do.to(SDT), tl.trans(b_h).to(SDT), input_precision=PREC) * (scale * tl.exp(b_G))
        b_dk = tl.dot(b_v.to(SDT), tl.trans(b_dh).to(SDT), input_precision=PREC) * b_kd
        b_gcs, b_M, b_tot = subchunk_stats(b_g, BT, BC, BK)
        b_dq, b_dk = subchunk_dqdk(b_dq, b_dk, b_dA, b_q, b_k, b_gcs, b_M, b_tot, q + i_h * K, k + i_h * K,
                                   g + i_h * K, t0, eos, o_k, m_k, H * K, BT, BC, DT, PREC)
        b_h = tl.dot(tl.trans((b_k * b_kd).to(DT)), b_v.to(DT), b_h * tl.exp(b_gl)[:, None], input_precision=PREC)
        # closed-form gate gradient (seed §4.3): reverse cumsum of q dq - k dk inside the chunk,
        # plus the chunk's outgoing-state term sum_v dh_n * h_n+1
        b_dG = b_q * b_dq - b_k * b_dk
        b_dg = tl.cumsum(b_dG, 0, reverse=True) + tl.sum(b_dh * b_h, 1)[None, :]
        tl.store(dq + p_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dg + p_k, b_dg.to(dg.dtype.element_ty), mask=m_tk)


@triton.jit
def gla_recurrent_kernel(
    q, k, v, g, o, h0, ht, cu, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
):
    """Token-by-token recurrence (decoding, seed §4.1): ``h = exp(g_t) h + k_t^T v_t``,
    ``o_t = scale q_t h``; the state stays in registers.  Grid ``(NV, N, H)``."""
    i_v, i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    if VARLEN:
        bos = tl.load(cu + i_n).to(tl.int64)
        eos = tl.load(cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_g = tl.load(g + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
        b_o = scale * tl.sum(b_q[:, None] * b_h, 0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
