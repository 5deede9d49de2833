"""Triton kernels of linear attention (docs/design/contract.md §2.4).

Notation: flat token-major tensors ``q, k [TT, H, K]``, ``v, o [TT, H, V]``; ``den [TT, H]`` the
normaliser; states ``h [K, V]`` (``S`` of the seed) and ``z [K]`` (key sum), fp32.  A program
owns one segment (see :mod:`lintime.ops.utils.segments`) and walks its chunks of ``BT`` tokens;
inside chunk ``n`` (seed, chunked mode)::

    o_i   = scale * (q_i h_n + sum_{j <= i} (q_i . k_j) v_j)        A = q k^T masked to j <= i
    den_i = scale * (q_i . z_n + sum_{j <= i} q_i . k_j)             (row sums of A)
    h_n+1 = h_n + k^T v,   z_n+1 = z_n + sum_j k_j

Backward, with ``do' = do / den`` and ``dd_i = -do_i . o_i / den_i`` when normalising (the
normaliser is the state of a value column that is constant 1, whose output gradient is ``dd``):

    dq_i = scale * (do'_i h_n^T + dd_i z_n + sum_{j <= i} (do'_i . v_j + dd_i) k_j)          (walk forward)
    dk_j = scale * sum_{i >= j} (v_j . do'_i + dd_i) q_i + v_j dh_n^T + dz_n                 (walk backward)
    dv_j = scale * sum_{i >= j} (k_j . q_i) do'_i + k_j dh_n
    dh_n-1 = dh_n + scale * q^T do',  dz_n-1 = dz_n + scale * sum_i q_i dd_i

where ``dh_n, dz_n`` are the gradients of the state after chunk ``n`` (``d final_state`` after the
last chunk).  Non-causal: every token reads the sequence's total state (``h, z`` fixed, no
masked part) and the total's gradient.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lintime.ops.utils.segments import segment_bounds


@triton.jit
def linear_fwd_kernel(
    q, k, v, o, den, h0, z0, hs, zs, ht, zt, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr, HAS_H0: tl.constexpr, MAT: tl.constexpr,
    SDT: tl.constexpr, PREC: tl.constexpr,
):
    """Output of one segment, V-block ``i_v``; grid ``(NV * NSEG, H)``.

    Start state: ``hs/zs[i_s]`` when materialised (``MAT``), else ``h0/z0[i_n]`` (or 0); non-causal
    calls read the sequence total ``ht/zt[i_n]``.  A causal call with one segment per sequence
    writes the final state ``ht/zt``.
    """
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
    b_z = tl.zeros([BK], dtype=tl.float32)
    if not CAUSAL:
        b_h += tl.load(ht + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(zt + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif MAT:
        b_h += tl.load(hs + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(zs + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(z0 + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    o_c = tl.arange(0, BT)
    m_causal = o_c[:, None] >= o_c[None, :]
    for c in range(tl.cdiv(eos - bos, BT)):
        o_t = bos + c * BT + o_c
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        # inter-chunk: the state entering the chunk (seed: Y_i = S_{cn} Q_i)
        b_o = tl.dot(b_q.to(SDT), b_h.to(SDT), input_precision=PREC)
        if NORM:
            b_d = tl.sum(b_q.to(tl.float32) * b_z[None, :], 1)
        if CAUSAL:
            b_k = tl.load(k + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_v = tl.load(v + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                          other=0.)
            # intra-chunk: masked score block (seed: sum_{j=cn+1}^{i} K_j^T Q_i V_j)
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            b_A = tl.where(m_causal, b_A, 0.)
            b_o = tl.dot(b_A.to(b_v.dtype), b_v, b_o, input_precision=PREC)
            if NORM:
                b_d += tl.sum(b_A, 1)
            b_h = tl.dot(tl.trans(b_k), b_v, b_h, input_precision=PREC)
            if NORM:
                b_z += tl.sum(b_k.to(tl.float32), 0)
        b_o = b_o * scale
        if NORM:
            b_d = tl.where(m_t, b_d * scale, 1.)
            b_o = b_o / b_d[:, None]
            if i_v == 0:
                tl.store(den + o_t * H + i_h, b_d, mask=m_t)
        tl.store(o + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
    if CAUSAL and not MAT:
        tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(zt + (i_n * H + i_h) * K + o_k, b_z, mask=m_k)


@triton.jit
def linear_bwd_prep_kernel(do, o, den, dd, TT, H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BV: tl.constexpr):
    """``dd_i = -do_i . o_i / den_i`` (the gradient of the normaliser); grid ``(cdiv(TT, BT), H)``."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = tl.arange(0, BV)
    m_t = o_t < TT
    m = m_t[:, None] & (o_v < V)[None, :]
    p = (o_t * H + i_h)[:, None] * V + o_v[None, :]
    b_do = tl.load(do + p, mask=m, other=0.).to(tl.float32)
    b_o = tl.load(o + p, mask=m, other=0.).to(tl.float32)
    b_den = tl.load(den + o_t * H + i_h, mask=m_t, other=1.)
    tl.store(dd + o_t * H + i_h, -tl.sum(b_do * b_o, 1) / b_den, mask=m_t)


@triton.jit
def linear_bwd_dq_kernel(
    k, v, do, den, dd, dq, h0, z0, hs, zs, ht, zt, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr, HAS_H0: tl.constexpr, MAT: tl.constexpr,
    SDT: tl.constexpr, PREC: tl.constexpr,
):
    """``dq`` of one segment, K-block ``i_k`` (all of V in the tile); forward walk carrying the
    forward state.  Grid ``(NK * NSEG, H)``."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s, i_k = i_p // NK, i_p % NK
    bos, eos, i_n, _ = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if not CAUSAL:
        b_h += tl.load(ht + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(zt + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif MAT:
        b_h += tl.load(hs + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(zs + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(z0 + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    o_c = tl.arange(0, BT)
    m_causal = o_c[:, None] >= o_c[None, :]
    for c in range(tl.cdiv(eos - bos, BT)):
        o_t = bos + c * BT + o_c
        m_t = o_t < eos
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if NORM:
            b_den = tl.load(den + o_t * H + i_h, mask=m_t, other=1.)
            b_dd = tl.load(dd + o_t * H + i_h, mask=m_t, other=0.)
            b_do = (b_do.to(tl.float32) / b_den[:, None]).to(b_do.dtype)
        b_dq = tl.dot(b_do.to(SDT), tl.trans(b_h).to(SDT), input_precision=PREC)
        if NORM:
            b_dq += b_dd[:, None] * b_z[None, :]
        if CAUSAL:
            b_k = tl.load(k + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.)
            b_v = tl.load(v + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
            b_dA = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
            if NORM:
                b_dA += b_dd[:, None]
            b_dA = tl.where(m_causal, b_dA, 0.)
            b_dq = tl.dot(b_dA.to(b_k.dtype), b_k, b_dq, input_precision=PREC)
            b_h = tl.dot(tl.trans(b_k), b_v, b_h, input_precision=PREC)
            if NORM:
                b_z += tl.sum(b_k.to(tl.float32), 0)
        tl.store(dq + (o_t * H + i_h)[:, None] * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])


@triton.jit
def linear_bwd_dkdv_kernel(
    q, k, v, do, den, dd, dk, dv, dht, dzt, dh0, dz0, ds, dzs, scale,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr, HAS_DHT: tl.constexpr, MAT: tl.constexpr,
    DO_DK: tl.constexpr, DO_DV: tl.constexpr, STORE_DH0: tl.constexpr, SDT: tl.constexpr, PREC: tl.constexpr,
):
    """``dk`` (tile ``[BK, all V]``) and/or ``dv`` (tile ``[all K, BV]``) of one segment: backward
    walk carrying the state gradient.  Grid ``(NBLK * NSEG, H)`` over K-blocks (``DO_DK`` only) or
    V-blocks (``DO_DV`` only), or one block of all of K and V (both).

    Start: ``ds/dzs[i_s]`` when materialised, else ``dht/dzt[i_n]`` (or 0); non-causal calls read
    the gradient of the sequence total from ``ds/dzs`` indexed by sequence.  With one segment per
    sequence, ``STORE_DH0`` writes the gradient of the initial state when the walk ends.
    """
    NBLK: tl.constexpr = (K + BK - 1) // BK if DO_DK and not DO_DV else (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s, i_b = i_p // NBLK, i_p % NBLK
    bos, eos, i_n, _ = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    if DO_DV and not DO_DK:
        o_k = tl.arange(0, BK)
        o_v = i_b * BV + tl.arange(0, BV)
    else:
        o_k = i_b * BK + tl.arange(0, BK)
        o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    b_dz = tl.zeros([BK], dtype=tl.float32)
    if not CAUSAL:
        b_dh += tl.load(ds + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_dz += tl.load(dzs + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif MAT:
        b_dh += tl.load(ds + (i_s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_dz += tl.load(dzs + (i_s * H + i_h) * K + o_k, mask=m_k, other=0.)
    elif HAS_DHT:
        b_dh += tl.load(dht + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_dz += tl.load(dzt + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    o_c = tl.arange(0, BT)
    m_rev = o_c[:, None] <= o_c[None, :]  # [j, i]: i >= j
    n_c = tl.cdiv(eos - bos, BT)
    for c in range(n_c):
        o_t = bos + (n_c - 1 - c) * BT + o_c
        m_t = o_t < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
        b_do = tl.load(do + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
        if NORM:
            b_den = tl.load(den + o_t * H + i_h, mask=m_t, other=1.)
            b_dd = tl.load(dd + o_t * H + i_h, mask=m_t, other=0.)
            b_do = (b_do.to(tl.float32) / b_den[:, None]).to(b_do.dtype)
        if DO_DK:
            b_v = tl.load(v + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.)
            b_dk = tl.dot(b_v.to(SDT), tl.trans(b_dh).to(SDT), input_precision=PREC)
            if NORM:
                b_dk += b_dz[None, :]
            if CAUSAL:
                b_dAt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)  # [j, i] = v_j . do'_i
                if NORM:
                    b_dAt += b_dd[None, :]
                b_dAt = tl.where(m_rev, b_dAt * scale, 0.)
                b_dk = tl.dot(b_dAt.to(b_q.dtype), b_q, b_dk, input_precision=PREC)
            tl.store(dk + (o_t * H + i_h)[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
        if DO_DV:
            b_k = tl.load(k + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.)
            b_dv = tl.dot(b_k.to(SDT), b_dh.to(SDT), input_precision=PREC)
            if CAUSAL:
                b_At = tl.dot(b_k, tl.trans(b_q), input_precision=PREC)  # [j, i] = k_j . q_i
                b_At = tl.where(m_rev, b_At * scale, 0.)
                b_dv = tl.dot(b_At.to(b_do.dtype), b_do, b_dv, input_precision=PREC)
            tl.store(dv + (o_t * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        if CAUSAL:
            b_dh += scale * tl.dot(tl.trans(b_q), b_do, input_precision=PREC)
            if NORM:
                if DO_DK:
                    b_dz += scale * tl.sum(b_q.to(tl.float32) * b_dd[:, None], 0)
    if STORE_DH0:
        if DO_DV:
            tl.store(dh0 + (i_n * H + i_h) * K * V + o_kv, b_dh, mask=m_kv)
        if NORM:
            if DO_DK:
                tl.store(dz0 + (i_n * H + i_h) * K + o_k, b_dz, mask=m_k)


@triton.jit
def linear_recurrent_kernel(
    q, k, v, o, h0, z0, ht, zt, cu, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, NORM: tl.constexpr, HAS_H0: tl.constexpr,
):
    """Token-by-token recurrence (decoding): ``h += k^T v``, ``z += k``, ``o = scale q h / (scale
    q . z)``; one program per (V-block, sequence, head), the state in registers.  Grid
    ``(NV, N, H)``."""
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
    b_z = tl.zeros([BK], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(z0 + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_h += b_k[:, None] * b_v[None, :]  # seed recurrent mode: S_i = S_{i-1} + V_i K_i^T
        b_o = scale * tl.sum(b_q[:, None] * b_h, 0)
        if NORM:
            b_z += b_k
            b_o = b_o / (scale * tl.sum(b_q * b_z, 0))
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
    if NORM:
        if i_v == 0:
            tl.store(zt + (i_n * H + i_h) * K + o_k, b_z, mask=m_k)
