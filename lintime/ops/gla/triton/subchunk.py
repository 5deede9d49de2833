"""Secondary (sub-chunk) tiling of GLA's in-chunk products: seed §4.3, Fig. 3.

Inside a chunk (rows i, j; sub-chunks I, J of BC rows), with g the log-gates (<= 0):
  A_ij = sum_k q_ik k_jk exp(G_ik - G_jk),  j <= i,   G_i - G_j = sum_{j < t <= i} g_t.

* Pairs in different sub-chunks (J < I, "inter", orange in Fig. 3): one half-precision matmul
  per sub-chunk I of the bounded factors q_i exp(G_i - z_I) and k_j exp(z_I - G_j), z_I = G at
  the last row before sub-chunk I; both exponents are <= 0.
* Pairs in the same sub-chunk ("intra", pink): fp32.  With gcs the cumulative gate inside each
  sub-chunk and M its total (per row, M <= gcs), exp(gcs_i - gcs_j) = exp(gcs_i - M) exp(M - gcs_j):
  when no sub-chunk of the chunk decays by more than SPAN_MAX nats (exp(SPAN_MAX) is far inside
  fp32's range) the whole diagonal band is one fp32 (IEEE) matmul of these factors; otherwise
  the chunk takes the direct log-space form, exp(gcs_i - gcs_j) per pair, row by row (seed
  Eq. 4 on the sub-chunk), which never overflows.  Both are fp32 and exact in real arithmetic;
  the guard only decides which one cannot overflow.

Every exponent is built from sums local to the sub-chunks involved (gcs and the sub-chunk
totals), never as the difference of two chunk-wide cumulative sums: those carry an absolute
rounding error of ulp(|G|), i.e. a relative error of |G| * 6e-8 on every term, which strong
decays (|G| in the hundreds) make visible.
"""

import triton
import triton.language as tl

BC = 16  # sub-chunk length (seed Fig. 3)

SPAN_MAX = tl.constexpr(60.0)
# One-level in-chunk products (GLA kernels, ``ONE_LEVEL``): factors e^{+-G} of a chunk-wide cumulative
# gate |G| < ONE_SPAN stay within [e^-40, e^40] = [4e-18, 2e17] -- inside bf16 / fp32 range with room
# for the products and sums of the matmul.
ONE_SPAN = tl.constexpr(40.0)


@triton.jit
def subchunk_stats(b_g, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """From the gate tile ``b_g [BT, BK]`` (fp32): ``gcs`` (cumulative gate of each row inside its
    sub-chunk), ``M`` (its sub-chunk's total, per row) and ``tot [NC, BK]`` (the totals)."""
    NC: tl.constexpr = BT // BC
    b_g3 = tl.reshape(b_g, (NC, BC, BK))
    b_gcs = tl.reshape(tl.cumsum(b_g3, 1), (BT, BK))
    b_tot = tl.sum(b_g3, 1)
    b_M = tl.reshape(tl.broadcast_to(tl.expand_dims(b_tot, 1), (NC, BC, BK)), (BT, BK))
    return b_gcs, b_M, b_tot


@triton.jit
def subchunk_ek(b_gcs, b_M, b_tot, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``z_I - G_j = sum_{j < t < I*BC} g_t`` for rows ``j`` before sub-chunk ``I`` (<= 0): the rest
    of ``j``'s own sub-chunk plus the totals of the sub-chunks in between (other rows: junk <= 0)."""
    NC: tl.constexpr = BT // BC
    sub = tl.arange(0, BT) // BC
    o_nc = tl.arange(0, NC)
    b_ek = b_M - b_gcs
    for L in tl.static_range(1, I):
        b_tot_L = tl.sum(tl.where(o_nc[:, None] == L, b_tot, 0.), 0)
        b_ek += tl.where((sub < L)[:, None], b_tot_L[None, :], 0.)
    return b_ek


@triton.jit
def subchunk_intra_direct(b_A, b_q, b_gcs, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
                          BT: tl.constexpr, BC: tl.constexpr):
    """``b_A += sum_k q_ik k_jk exp(gcs_ik - gcs_jk)`` for ``j <= i`` in the same sub-chunk, the
    direct log-space form, row ``j`` of every sub-chunk at a time (``k_ptr``/``g_ptr`` point at
    the head's first feature, row stride ``STRIDE``; rows ``t0 + r >= eos`` read as zero)."""
    o = tl.arange(0, BT)
    r_in = o % BC
    base = o - r_in
    b_run = tl.zeros_like(b_gcs)  # gcs at row base + j of each sub-chunk
    for j in range(BC):
        o_r = t0 + base + j
        m_r = (o_r < eos)[:, None] & m_k[None, :]
        b_kj = tl.load(k_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
        b_run += tl.load(g_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
        b_e = tl.exp(tl.where((r_in >= j)[:, None], b_gcs - b_run, float("-inf")))
        b_a = tl.sum(b_q * b_kj * b_e, 1)
        b_A += tl.where(o[None, :] == (base + j)[:, None], b_a[:, None], 0.)
    return b_A


@triton.jit
def subchunk_A(b_q, b_k, b_gcs, b_M, b_tot, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
               BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The in-chunk score block ``A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` (``j <= i``, else 0),
    ``[BT, BT]`` fp32, from fp32 tiles ``b_q, b_k [BT, BK]`` and :func:`subchunk_stats`."""
    NC: tl.constexpr = BT // BC
    o = tl.arange(0, BT)
    sub = o // BC
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for I in tl.static_range(1, NC):  # inter-sub-chunk (seed Fig. 3 orange)
        b_ek = subchunk_ek(b_gcs, b_M, b_tot, I, BT, BC)
        b_qg = tl.where((sub == I)[:, None], b_q * tl.exp(b_gcs), 0.)
        b_kg = tl.where((sub < I)[:, None], b_k * tl.exp(b_ek), 0.)
        b_A = tl.dot(b_qg.to(DT), tl.trans(b_kg.to(DT)), b_A, input_precision=PREC)
    m_band = (sub[:, None] == sub[None, :]) & (o[:, None] >= o[None, :])
    if tl.max(tl.max(-b_tot, 1), 0) < SPAN_MAX:  # intra-sub-chunk (pink), fp32
        b_qf = b_q * tl.exp(b_gcs - b_M)
        b_kf = b_k * tl.exp(b_M - b_gcs)
        b_A += tl.where(m_band, tl.dot(b_qf, tl.trans(b_kf), input_precision="ieee"), 0.)
    else:
        b_A = subchunk_intra_direct(b_A, b_q, b_gcs, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE, BT, BC)
    return b_A


@triton.jit
def subchunk_dqdk(b_dq, b_dk, b_dA, b_q, b_k, b_gcs, b_M, b_tot, q_ptr, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
                  BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``b_dq += sum_{j <= i} dA_ij k_j exp(G_i - G_j)`` and ``b_dk += sum_{i >= j} dA_ij q_i
    exp(G_i - G_j)`` (``b_dA [BT, BT]`` fp32, masked to ``j <= i``), the same tiling as
    :func:`subchunk_A`."""
    NC: tl.constexpr = BT // BC
    o = tl.arange(0, BT)
    sub = o // BC
    for I in tl.static_range(1, NC):  # inter-sub-chunk, half precision
        b_ek = subchunk_ek(b_gcs, b_M, b_tot, I, BT, BC)
        b_eq = tl.where((sub == I)[:, None], tl.exp(b_gcs), 0.)
        b_ekx = tl.where((sub < I)[:, None], tl.exp(b_ek), 0.)
        b_dAI = tl.where((sub == I)[:, None] & (o[None, :] < I * BC), b_dA, 0.).to(DT)
        b_dq += b_eq * tl.dot(b_dAI, (b_k * b_ekx).to(DT), input_precision=PREC)
        b_dk += b_ekx * tl.dot(tl.trans(b_dAI), (b_q * b_eq).to(DT), input_precision=PREC)
    b_dAd = tl.where(sub[:, None] == sub[None, :], b_dA, 0.)
    if tl.max(tl.max(-b_tot, 1), 0) < SPAN_MAX:  # intra-sub-chunk, fp32
        b_eu = tl.exp(b_gcs - b_M)  # >= 1
        b_ed = tl.exp(b_M - b_gcs)  # <= 1
        b_dq += b_eu * tl.dot(b_dAd, b_k * b_ed, input_precision="ieee")
        b_dk += b_ed * tl.dot(tl.trans(b_dAd), b_q * b_eu, input_precision="ieee")
    else:  # direct log space, row by row
        r_in = o % BC
        base = o - r_in
        b_dAt = tl.trans(b_dAd)  # [j, i]
        b_run = tl.zeros_like(b_gcs)
        for j in range(BC):
            o_r = t0 + base + j
            m_r = (o_r < eos)[:, None] & m_k[None, :]
            b_kj = tl.load(k_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            b_qj = tl.load(q_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            b_run += tl.load(g_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            m_c = o[None, :] == (base + j)[:, None]
            # dq: row i meets column base_i + j (j <= r_in(i))
            b_e = tl.exp(tl.where((r_in >= j)[:, None], b_gcs - b_run, float("-inf")))
            b_dq += tl.sum(tl.where(m_c, b_dAd, 0.), 1)[:, None] * b_kj * b_e
            # dk: row j' meets row base_j' + j of dA (j >= r_in(j'))
            b_e = tl.exp(tl.where((r_in <= j)[:, None], b_run - b_gcs, float("-inf")))
            b_dk += tl.sum(tl.where(m_c, b_dAt, 0.), 1)[:, None] * b_qj * b_e
    return b_dq, b_dk
