"""Triton kernels of gated linear attention (docs/design/contract.md §2.5; seed §4.2-4.3).

Notation: flat token-major ``q, k, g [TT, H, K]``, ``v, o [TT, H, V]``; inside a chunk of ``BT``
tokens ``G_i`` = in-chunk cumulative log-gate (fp32, computed with ``tl.cumsum``), ``G_l`` = its
last value; ``h_n`` = state entering chunk ``n``, ``[K, V]`` fp32.  Chunkwise form (seed §4.2)::

    A_ij  = scale * sum_k q_ik k_jk exp(G_ik - G_jk),  j <= i
    o_i   = scale * qg_i h_n + sum_j A_ij v_j,          qg = q * exp(G)
    h_n+1 = exp(G_l) * h_n + kg^T v,                    kg = k * exp(G_l - G)

``gla_fwd_prep_kernel`` (parallel over chunks) computes, once per chunk, ``A`` (secondary tiling of
:mod:`lintime.ops.gla.triton.subchunk`; fp32 ``[TT, H, BT]``), the gated inputs ``qg, kg`` (input dtype)
and the chunk's total log-decay ``G_l`` (fp32 ``[NCH, H, K]``).  Both gate factors are ``<= 1``
(``G`` is a sum of log-gates ``<= 0``), so ``|qg| <= |q|`` and ``|kg| <= |k|``: storing them in the
input dtype rounds them like the inputs themselves (bf16 / fp16 relative 2^-8 / 2^-11; fp16
underflow only for factors below 6e-8, whose terms are below the half-precision rounding of the
output).  The walks then are linear-attention walks whose state decays by one vector per chunk:
no cumulative sums on the sequential path.  The output walk also writes ``h_n`` per chunk
(``hc``, bf16 for bf16 inputs, else fp32) for the backward.

Backward (seed §4.3), ``dh_n`` = gradient of the state after chunk ``n``::

    dh_n-1 = exp(G_l) dh_n + scale * qg^T do
    dv_j   = sum_i A_ij do_i + kg_j dh_n                                    (gla_bwd_dv_kernel, walks
                                                                              backward, writes dh_n)
    dA_ij  = scale * do_i . v_j                                             (gla_bwd_dqkg_kernel,
    dq_i   = scale * exp(G_i) (do_i h_n^T) + sum_{j<=i} dA_ij k_j exp(G_i - G_j)   parallel over
    dk_j   = exp(G_l - G_j) (v_j dh_n^T) + sum_{i>=j} dA_ij q_i exp(G_i - G_j)     chunks)
    dg_t   = sum_{i >= t in chunk} (q_i dq_i - k_i dk_i) + sum_v (dh_n * h_n+1)      (closed form)

with ``sum_v dh_n * h_n+1 = exp(G_l) sum_v (dh_n * h_n) + sum_j k_j dk_j^inter`` (``h_n+1 =
exp(G_l) h_n + kg^T v`` and ``kg_j (v_j dh_n^T) = k_j dk_j^inter``), so the gate gradient needs only
the per-chunk ``h_n`` and ``dh_n``: the dq/dk/dg kernel has no sequential dependency.

**One-level in-chunk products (``ONE_LEVEL``, bf16 inputs by default).**  The in-chunk parts need
``exp(G_i - G_j)`` per pair.  The secondary tiling (:mod:`lintime.ops.gla.triton.subchunk`) builds them
from sub-chunk-local sums so that no factor overflows whatever the decay.  When the K-block's
cumulative gates stay inside ``ONE_SPAN`` nats (checked at run time per chunk and K-block; typical
GLA gates decay a few nats per 64 tokens) one matmul of the whole chunk does it instead::

    A    = tril( (q e^G) (k e^-G)^T )          dq += e^G  (dA (k e^-G))       dk += e^-G (dA^T (q e^G))

Every factor lies in ``[e^-40, e^40]`` (far inside bf16's range, which is fp32's); each operand is
rounded once to the input dtype, as in any half-precision matmul of the inputs.  K-blocks beyond
the span take the secondary tiling.  fp16 (range 65504) and fp32 inputs (whose users get the
sub-chunk-local fp32 exponents) keep the secondary tiling (:class:`~lintime.ops.gla.triton.launch.GLALaunch`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lintime.ops.gla.triton.subchunk import ONE_SPAN, subchunk_A, subchunk_dqdk, subchunk_stats
from lintime.ops.utils.segments import segment_bounds


@triton.jit
def gla_fwd_prep_kernel(
    q, k, g, A, qg, kg, gl, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    VARLEN: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, ONE_LEVEL: tl.constexpr,
):
    """One chunk (layout: one segment per chunk), grid ``(NCH, H)``: the in-chunk score block
    ``A [BT, BT]`` (row ``t`` = scores of token ``t`` against its chunk; summed over K-blocks of
    ``BK``, every factor is per feature), the gated inputs ``qg = q exp(G)``, ``kg = k exp(G_l - G)``
    (``G_l - G_j`` as the sum of the gates after ``j``, not a difference of cumulative sums) and
    ``gl = G_l`` (row ``ch`` of ``[NCH, H, K]``)."""
    i_c, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    bos, eos, _, ch = segment_bounds(seg, i_c, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
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
        b_g = tl.load(g + p, mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)
        b_qe = b_q * tl.exp(b_G)
        tl.store(qg + p, b_qe.to(qg.dtype.element_ty), mask=m_tk)
        tl.store(kg + p, (b_k * tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)).to(kg.dtype.element_ty), mask=m_tk)
        tl.store(gl + (ch * H + i_h) * K + o_k, tl.sum(b_g, 0), mask=m_k)
        if ONE_LEVEL and tl.max(tl.max(tl.abs(b_G), 1), 0) < ONE_SPAN:
            # pairs above the diagonal carry junk (e^{G_i - G_j} > 1): masked below
            b_A = tl.dot(b_qe.to(DT), tl.trans((b_k * tl.exp(-b_G)).to(DT)), b_A, input_precision=PREC)
        else:
            b_gcs, b_M, b_tot = subchunk_stats(b_g, BT, BC, BK)
            b_A += subchunk_A(b_q, b_k, b_gcs, b_M, b_tot, k + i_h * K, g + i_h * K, bos, eos, o_k, m_k, H * K, BT,
                              BC, DT, PREC)
    o_c = tl.arange(0, BT)
    b_A = tl.where(o_c[:, None] >= o_c[None, :], b_A * scale, 0.)
    tl.store(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], b_A, mask=m_t[:, None])


@triton.jit
def gla_seg_summary_kernel(
    x, y, gl, delta, gsum, alpha,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, REVERSE: tl.constexpr, PREC: tl.constexpr,
):
    """What segment ``i_s`` adds to a ``[K, V]`` state, from gated inputs: ``delta = alpha * walk
    of S <- exp(G_l) S + x^T y`` over its chunks (forward: ``x = kg, y = v``, chunks in order;
    reverse: ``x = qg, y = do``, last chunk first) and ``gsum`` = its total log-decay.  The same
    outputs as ``lintime.ops.utils.state_passing.seg_summary_kernel`` (for ``seg_scan_kernel``) without any gate
    arithmetic.  Grid ``(NK * NV * NSEG, H)``."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s = i_p // (NK * NV)
    i_k = (i_p % (NK * NV)) // NV
    i_v = i_p % NV
    bos, eos, i_n, ch0 = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    b_d = tl.zeros([BK, BV], dtype=tl.float32)
    b_gs = tl.zeros([BK], dtype=tl.float32)
    n_c = tl.cdiv(eos - bos, BT)
    for c in range(n_c):
        if REVERSE:
            i_c = n_c - 1 - c
        else:
            i_c = c
        o_t = bos + i_c * BT + tl.arange(0, BT)
        m_t = o_t < eos
        b_x = tl.load(x + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_y = tl.load(y + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        b_gl = tl.load(gl + ((ch0 + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_d = tl.dot(tl.trans(b_x), b_y, b_d * tl.exp(b_gl)[:, None], input_precision=PREC)
        b_gs += b_gl
    p_d = delta + ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p_d, b_d * alpha, mask=m_k[:, None] & m_v[None, :])
    if i_v == 0:
        tl.store(gsum + (i_s * H + i_h) * K + o_k, b_gs, mask=m_k)


@triton.jit
def gla_fwd_kernel(
    qg, kg, v, gl, A, o, h0, hs, ht, hc, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, MAT: tl.constexpr, STORE_HC: tl.constexpr, DT: tl.constexpr,
    SDT: tl.constexpr, PREC: tl.constexpr,
):
    """Output of one segment, V-block ``i_v`` (all of K in the tile); the state walks the
    segment's chunks in registers and is written per chunk (``hc [NCH, H, K, V]``, the state
    entering the chunk) for the backward when ``STORE_HC``.  Grid ``(NV * NSEG, H)``."""
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
        if STORE_HC:
            tl.store(hc + ((ch0 + c) * H + i_h) * K * V + o_kv, b_h.to(hc.dtype.element_ty), mask=m_kv)
        p_k = (o_t * H + i_h)[:, None] * K + o_k[None, :]
        b_qg = tl.load(qg + p_k, mask=m_tk, other=0.)
        b_kg = tl.load(kg + p_k, mask=m_tk, other=0.)
        b_gl = tl.load(gl + ((ch0 + c) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_v = tl.load(v + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_A = tl.load(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.)
        # inter-chunk: queries read the incoming state through their decay from the chunk start
        b_o = tl.dot(b_qg.to(SDT), b_h.to(SDT), input_precision=PREC) * scale
        b_o = tl.dot(b_A.to(DT), b_v.to(DT), b_o, input_precision=PREC)
        tl.store(o + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        # seed Eq. 2 (chunk recurrence), every exponent <= 0
        b_h = tl.dot(tl.trans(b_kg), b_v, b_h * tl.exp(b_gl)[:, None], input_precision=PREC)
    if not MAT:
        tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)


@triton.jit
def gla_bwd_dv_kernel(
    qg, kg, gl, A, do, dv, dht, dh0, ds, dhs, scale,
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
        b_qg = tl.load(qg + p_k, mask=m_tk, other=0.)
        b_kg = tl.load(kg + p_k, mask=m_tk, other=0.)
        b_gl = tl.load(gl + ((ch0 + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_do = tl.load(do + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        b_A = tl.load(A + (o_t * H + i_h)[:, None] * BT + o_c[None, :], mask=m_t[:, None], other=0.)
        b_dv = tl.dot(b_kg.to(SDT), b_dh.to(SDT), input_precision=PREC)
        b_dv = tl.dot(tl.trans(b_A).to(DT), b_do.to(DT), b_dv, input_precision=PREC)
        tl.store(dv + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_dh = b_dh * tl.exp(b_gl)[:, None] + scale * tl.dot(tl.trans(b_qg), b_do.to(DT), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + o_kv, b_dh, mask=m_kv)


@triton.jit
def gla_bwd_dqkg_kernel(
    q, k, v, g, do, hc, dhs, dq, dk, dg, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, VARLEN: tl.constexpr, DT: tl.constexpr, SDT: tl.constexpr,
    PREC: tl.constexpr, ONE_LEVEL: tl.constexpr,
):
    """``dq, dk, dg`` of one chunk (layout: one segment per chunk), K-block ``i_k``, from the
    chunk's state ``h_n`` (``hc``) and state gradient ``dh_n`` (``dhs``); V is walked in blocks of
    ``BV`` (``do h^T``, ``v dh^T``, ``do v^T`` and ``sum_v h * dh`` accumulate in fp32).  No sequential
    dependency: grid ``(NK * NCH, H)``, the K-blocks of a
    chunk adjacent (they share ``do, v`` through L2)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_c, i_k = i_p // NK, i_p % NK
    bos, eos, _, ch = segment_bounds(seg, i_c, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_c = tl.arange(0, BT)
    o_t = bos + o_c
    m_t = o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        p_v = (o_t * H + i_h)[:, None] * V + o_v[None, :]
        p_h = ((ch * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.)
        b_h = tl.load(hc + p_h, mask=m_kv, other=0.)
        b_dh = tl.load(dhs + p_h, mask=m_kv, other=0.)
        b_dq = tl.dot(b_do.to(SDT), tl.trans(b_h).to(SDT), b_dq, input_precision=PREC)
        b_dk = tl.dot(b_v.to(SDT), tl.trans(b_dh).to(SDT), b_dk, input_precision=PREC)
        b_dA = tl.dot(b_do.to(DT), tl.trans(b_v.to(DT)), b_dA, input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    p_k = (o_t * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_g = tl.load(g + p_k, mask=m_tk, other=0.).to(tl.float32)
    b_gl = tl.sum(b_g, 0)
    b_G = tl.cumsum(b_g, 0)
    b_dq = b_dq * (scale * tl.exp(b_G))
    b_dk = b_dk * tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)  # exp(G_last - G_j)
    # sum_v dh_n * h_n+1 (the chunk's outgoing-state term of the gate gradient)
    b_dgs = tl.exp(b_gl) * b_hdh + tl.sum(b_k * b_dk, 0)
    b_dA = tl.where(o_c[:, None] >= o_c[None, :], b_dA * scale, 0.)
    if ONE_LEVEL and tl.max(tl.max(tl.abs(b_G), 1), 0) < ONE_SPAN:
        b_dAh = b_dA.to(DT)
        b_dq += tl.exp(b_G) * tl.dot(b_dAh, (b_k * tl.exp(-b_G)).to(DT), input_precision=PREC)
        b_dk += tl.exp(-b_G) * tl.dot(tl.trans(b_dAh), (b_q * tl.exp(b_G)).to(DT), input_precision=PREC)
    else:
        b_gcs, b_M, b_tot = subchunk_stats(b_g, BT, BC, BK)
        b_dq, b_dk = subchunk_dqdk(b_dq, b_dk, b_dA, b_q, b_k, b_gcs, b_M, b_tot, q + i_h * K, k + i_h * K,
                                   g + i_h * K, bos, eos, o_k, m_k, H * K, BT, BC, DT, PREC)
    # closed-form gate gradient (seed §4.3): reverse cumsum of q dq - k dk inside the chunk
    b_dg = tl.cumsum(b_q * b_dq - b_k * b_dk, 0, reverse=True) + b_dgs[None, :]
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
