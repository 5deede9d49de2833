"""Chunk-state passing between segments (see :mod:`lintime.ops.utils.segments` for the layout).

When sequences are cut into several segments, the state entering each one is materialised in
three steps:

1. :func:`seg_summary_kernel` -- in parallel over segments, what each segment adds to the state
   (``delta``) and its total log-decay (``gsum``);
2. :func:`seg_scan_kernel` -- per sequence, a short scan over its segments gives the state
   entering each one (and the final state);
3. the op's walk kernel starts each segment from that state.

Backward passes use the same machinery in reverse for the state gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import block, cdiv, dot_config
from lintime.ops.utils.segments import BT, Segments, segment_bounds, sequence_segments

@triton.jit
def seg_summary_kernel(
    x, y, g, w, rdiv, delta, dz, gsum, alpha,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
    HAS_RDIV: tl.constexpr, SDT: tl.constexpr, PREC: tl.constexpr,
):
    """What segment ``i_s`` adds to a ``[K, V]`` state: ``delta = alpha * sum_t d_t x_t^T y_t``
    with the decays ``d_t`` of the walk direction, and (``NORM``) the key-sum column
    ``dz = alpha * sum_t d_t x_t w_t`` (``w = 1`` when absent); ``gsum`` = total log-decay.

    Forward (``REVERSE=False``, x = k, y = v): the chunk recurrence ``S <- exp(G_last) S +
    (x exp(G_last - G))^T y`` (seed §4.2), chunks in order.  Reverse (x = q, y = do): the state
    gradient ``dS <- exp(G_last) dS + (x exp(G))^T y``, chunks from last to first.  ``G`` is the
    in-chunk cumulative log-gate (fp32, every exponent <= 0).  ``rdiv`` divides each row of ``y``
    (the normaliser of linear attention: ``do / den``).  Grid ``(NK * NV * NSEG, H)``.
    """
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
    b_z = tl.zeros([BK], dtype=tl.float32)
    b_gs = tl.zeros([BK], dtype=tl.float32)
    n_c = tl.cdiv(eos - bos, BT)
    for c in range(n_c):
        if REVERSE:
            t0 = bos + (n_c - 1 - c) * BT
        else:
            t0 = bos + c * BT
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        b_x = tl.load(x + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_y = tl.load(y + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        if HAS_RDIV:
            b_r = tl.load(rdiv + o_t * H + i_h, mask=m_t, other=1.)
            b_y = (b_y.to(tl.float32) / b_r[:, None]).to(b_x.dtype)
        if NORM:
            if HAS_W:
                b_w = tl.load(w + o_t * H + i_h, mask=m_t, other=0.)
            else:
                b_w = tl.where(m_t, 1., 0.)
        if USE_G:
            b_g = tl.load(g + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.).to(tl.float32)
            b_gl = tl.sum(b_g, 0)  # G at the chunk's last token (padding rows add 0)
            if REVERSE:
                b_xd = b_x.to(tl.float32) * tl.exp(tl.cumsum(b_g, 0))
            else:
                # G_last - G_j as the sum of the gates after j (not a difference of large sums)
                b_xd = b_x.to(tl.float32) * tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)
            b_d = b_d * tl.exp(b_gl)[:, None]
            b_d = tl.dot(tl.trans(b_xd.to(b_x.dtype)), b_y, b_d, input_precision=PREC)
            b_gs += b_gl
        else:
            b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
            if NORM:
                b_z += tl.sum(b_x.to(tl.float32) * b_w[:, None], 0)
    p_d = delta + ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p_d, b_d * alpha, mask=m_k[:, None] & m_v[None, :])
    if i_v == 0:
        if NORM:
            tl.store(dz + (i_s * H + i_h) * K + o_k, b_z * alpha, mask=m_k)
        if USE_G:
            tl.store(gsum + (i_s * H + i_h) * K + o_k, b_gs, mask=m_k)


@triton.jit
def seg_scan_kernel(
    delta, dz, gsum, init, init_z, start, start_z, final, final_z,
    seq_ptr, NSPS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr, NORM: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_START: tl.constexpr,
):
    """Per sequence, pass the state along its segments: ``start[s]`` = state entering segment
    ``s`` in the walk direction, ``final[n]`` = state after the sequence (forward: the final
    state; reverse: the gradient of the initial state).  ``init`` (``[N, H, K, V]``) is the
    state a sequence starts from (forward: ``initial_state``, reverse: ``d final_state``).
    Empty sequences have no segments: ``final = init``.  Grid ``(NK * NV, N, H)``; small tiles
    so that the sequential loop has many programs.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    i_kv, i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_k, i_v = i_kv // NV, i_kv % NV
    s0, s1 = sequence_segments(seq_ptr, i_n, NSPS, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if HAS_INIT:
        b_h += tl.load(init + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(init_z + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    for i in range(s1 - s0):
        if REVERSE:
            s = s1 - 1 - i
        else:
            s = s0 + i
        if STORE_START:
            tl.store(start + (s * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
            if NORM:
                if i_v == 0:
                    tl.store(start_z + (s * H + i_h) * K + o_k, b_z, mask=m_k)
        b_d = tl.load(delta + (s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if USE_G:
            b_h = b_h * tl.exp(tl.load(gsum + (s * H + i_h) * K + o_k, mask=m_k, other=0.))[:, None]
        b_h += b_d
        if NORM:
            b_z += tl.load(dz + (s * H + i_h) * K + o_k, mask=m_k, other=0.)
    tl.store(final + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
    if NORM:
        if i_v == 0:
            tl.store(final_z + (i_n * H + i_h) * K + o_k, b_z, mask=m_k)


def segment_states(x, y, seg: Segments, *, H: int, g=None, w=None, rdiv=None, reverse=False, alpha=1.0,
                   init=None, init_z=None, norm=False, store_start=True):
    """States entering each segment (``[NSEG_ALLOC, H, K, V]`` fp32, and the key-sum column
    ``[NSEG_ALLOC, H, K]`` when ``norm``) and after each sequence (``[N, H, K, V]``, ``[N, H, K]``).

    ``x [TT, H, K]``, ``y [TT, H, V]`` flat token-major views; see :func:`seg_summary_kernel`
    for ``g, w, rdiv, reverse, alpha``.  Returns ``(start, start_z, final, final_z)``; the
    ``*_z`` are empty tensors unless ``norm``.
    """
    K, V = x.shape[-1], y.shape[-1]
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    SDT, PREC = dot_config(x.dtype)
    NSEG = seg.NSEG
    delta = torch.empty(max(NSEG, 1), H, K, V, **f32)
    dz = torch.empty(max(NSEG, 1), H, K, **f32) if norm else delta
    gsum = torch.empty(max(NSEG, 1), H, K, **f32) if g is not None else delta
    la = seg.kernel_args()
    BK, BV = min(64, block(K)), min(64, block(V))
    if NSEG > 0:
        grid = (cdiv(K, BK) * cdiv(V, BV) * NSEG, H)
        seg_summary_kernel[grid](
            x, y, g, w, rdiv, delta, dz, gsum, float(alpha), **la, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_G=g is not None, REVERSE=reverse, NORM=norm, HAS_W=w is not None, HAS_RDIV=rdiv is not None,
            SDT=SDT, PREC=PREC, num_warps=4,
        )
    start = torch.empty(seg.NSEG_ALLOC, H, K, V, **f32) if store_start else delta
    start_z = (torch.empty(seg.NSEG_ALLOC, H, K, **f32) if (store_start and norm)
               else x.new_empty(0, dtype=torch.float32))
    final = torch.empty(seg.N, H, K, V, **f32)
    final_z = torch.empty(seg.N, H, K, **f32) if norm else x.new_empty(0, dtype=torch.float32)
    if seg.N > 0:
        SK, SV = min(32, block(K)), min(32, block(V))
        grid = (cdiv(K, SK) * cdiv(V, SV), seg.N, H)
        seg_scan_kernel[grid](
            delta, dz, gsum, init, init_z, start, start_z, final, final_z, seg.seq_ptr, seg.NSPS,
            H=H, K=K, V=V, BK=SK, BV=SV, VARLEN=seg.varlen, USE_G=g is not None, REVERSE=reverse, NORM=norm,
            HAS_INIT=init is not None, STORE_START=store_start, num_warps=2,
        )
    return start, start_z, final, final_z
