"""The fused Transformer-VQ decoding step (:func:`lintime.ops.vq.decode.vq_decode_step_`, ``backend="triton"``):
a scores kernel, a values kernel (with a combine kernel when the keys are split), the block end's merge and shift
kernels and the position increment, every one a fixed-shape launch that reads the positions on the device (no host
read), so a CUDA graph replays the step.  The ``2L + S`` keys of a token are the window slots ``[0, 2L)`` then the
``S`` codes; each sequence's keys are read and scored once, then every value tile reads the scores.

* ``vq_decode_scores_kernel`` -- per (sequence, head, block of ``BT`` keys): the fp32 scores into a scratch
  ``s [N H, 2L + S]``: a window slot ``q . k`` (the token's own slot ``L + pos % L`` scored from the registers
  that hold its key), the bias added or formed from a relative table (``qv . r[m]`` at distance ``m <= L``),
  ``-inf`` where the slot is not visible (causal: slots ``[0, L)`` once ``pos >= L``, slots ``[L, L + pos % L]``);
  a code ``q . codebook + log count``, ``-inf`` where its count is 0.  The program whose block holds the token's
  slot writes the token's key, code and value there (the values kernel, launched after, reads them);
* ``vq_decode_values_kernel`` -- per (sequence, head, value tile, key split): the softmax's max and denominator
  from the whole score row (``2L + S`` fp32 from the L2, once per program), then the probabilities of its
  split's keys weight the visible window values and the fp32 running means of the cache (the rows of invisible
  slots are not read).  When a step has few programs (small batches) the keys are split over more
  (flash-decoding): each split writes its share of the normalised output to a scratch that
  ``vq_decode_combine_kernel`` sums into the output;
* ``vq_decode_merge_kernel`` -- per (sequence, head, code tile), only when the token completes a block and a
  previous block exists (else it returns at once): the previous block's per-code count and value sum (a one-hot
  product, once per ``L`` tokens), merged into the running (count, mean) of the cache (seed Code 2 ``scan_func``);
  each program owns its codes' counts and means, so no program reads what another writes;
* ``vq_decode_shift_kernel`` -- per (sequence, head, slot tile), only at a block end: slots ``[L, 2L)`` move to
  ``[0, L)`` and ``[L, 2L)`` are zeroed (keys, values, codes), after the merge has read the previous block;
* ``pos += 1`` (one PyTorch add, after every kernel has read ``pos``).

Scores, softmax and sums are fp32; the window buffers keep the inputs' dtype, the cache fp32.  Notation:
``N`` sequences, ``H`` heads, ``K`` key width, ``V`` value width, ``S`` codes, ``L`` block length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import block, cdiv, check_device
from lintime.ops.vq.triton.launch import VQLaunch, default_launch

NEG = tl.constexpr(-1.0e30)  # the running max's start: finite, so a chunk of -inf scores gives exp(-inf - NEG) = 0


@triton.jit
def vq_decode_scores_kernel(q, kn, zn, vn, cb, bias, qv, rt, st_k, st_v, st_z, st_c, pos, s, L, S,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_REL: tl.constexpr):
    """Grid ``(N * H, cdiv(2L + S, BT))``.  ``q``, ``kn`` ``[N, H, K]``, ``zn`` ``[N, H]``, ``vn`` ``[N, H, V]``,
    ``cb`` ``[H, S, K]``, ``bias`` ``[N, H, 2L]``, the relative bias ``qv [N, H, K]`` and ``rt [L + 1, H, K]``; state
    ``st_k [N, 2L, H, K]``, ``st_v [N, 2L, H, V]``, ``st_z [N, 2L, H]``, ``st_c [N, H, S]``, ``pos [N]``; the scores
    ``s [N H, 2L + S]`` fp32 of keys ``[i BT, (i + 1) BT)`` (window slots, then codes)."""
    i_nh, i_t = tl.program_id(0), tl.program_id(1)
    n = (i_nh // H).to(tl.int64)
    h = i_nh % H
    p = tl.load(pos + n).to(tl.int32)
    new = L + p % L  # the token's window slot
    W = 2 * L
    row = n * W  # the sequence's first window slot
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_q = tl.load(q + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_kn = tl.load(kn + i_nh * K + o_k, mask=m_k, other=0.0)
    t0 = i_t * BT
    if (t0 <= new) & (new < t0 + BT):  # this block holds the token's slot: its key, code and value go there
        tl.store(st_k + ((row + new) * H + h) * K + o_k, b_kn.to(st_k.dtype.element_ty), mask=m_k)
        tl.store(st_z + (row + new) * H + h, tl.load(zn + i_nh).to(st_z.dtype.element_ty))
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            b_vn = tl.load(vn + i_nh * V + o_v, mask=o_v < V, other=0.0)
            tl.store(st_v + ((row + new) * H + h) * V + o_v, b_vn.to(st_v.dtype.element_ty), mask=o_v < V)
    o_t = t0 + tl.arange(0, BT)
    # the window (seed Eq. 29-30); only visible slots' keys are read
    m_w = o_t < W
    o_j = tl.where(m_w, o_t, 0)
    vis = m_w & (o_j >= tl.where(p >= L, 0, L)) & (o_j <= new)
    b_k = tl.load(st_k + ((row + o_j[:, None]) * H + h) * K + o_k[None, :], mask=vis[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)  # [BT, BK]
    s_new = tl.sum(b_q * b_kn.to(tl.float32), 0)  # the token's own slot, from registers (the store above)
    b_sw = tl.where(o_j == new, s_new, tl.sum(b_k * b_q[None, :], 1))
    if HAS_BIAS:
        b_sw += tl.load(bias + i_nh * W + o_j, mask=vis, other=0.0).to(tl.float32)
    if HAS_REL:  # slot j is at distance new - j from the token; none beyond L (seed Theorem 3.6)
        b_qv = tl.load(qv + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_r = new - o_j
        ok = vis & (m_r <= L)  # a visible slot has m_r >= 0
        b_r = tl.load(rt + (tl.where(ok, m_r, 0)[:, None] * H + h) * K + o_k[None, :],
                      mask=ok[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        b_sw += tl.sum(b_r * b_qv[None, :], 1)
    # the cache (seed Eq. 28, Remark 3.9): codes with a count, log count added
    m_s = (o_t >= W) & (o_t < W + S)
    o_s = tl.where(m_s, o_t - W, 0)
    b_c = tl.load(st_c + i_nh * S + o_s, mask=m_s, other=0.0)
    b_cb = tl.load(cb + (h * S + o_s[:, None]) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :],
                   other=0.0).to(tl.float32)  # [BT, BK]
    b_ss = tl.sum(b_cb * b_q[None, :], 1) + tl.log(tl.where(b_c > 0, b_c, 1.0))
    b_s = tl.where(vis, b_sw, tl.where(m_s & (b_c > 0), b_ss, float("-inf")))
    tl.store(s + i_nh * (W + S) + o_t, b_s, mask=o_t < W + S)


@triton.jit
def vq_decode_values_kernel(s, st_v, st_m, pos, o, part_o, L, S, CH, NSPLIT, H: tl.constexpr, V: tl.constexpr,
                            BN: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
                            SPLIT: tl.constexpr):
    """Grid ``(N * H, cdiv(V, BV), NSPLIT)``: the scores ``s [N H, 2L + S]`` of :func:`vq_decode_scores_kernel`
    weight the window values ``st_v [N, 2L, H, V]`` and the cache means ``st_m [N, H, S, V]`` (fp32) of value tile
    ``[BV]``.  Split ``i`` takes keys ``[i CH, (i + 1) CH)``; with ``SPLIT`` it writes its share of the normalised
    output to ``part_o [N H, NSPLIT, V]`` (fp32) for :func:`vq_decode_combine_kernel`, else ``o [N, H, V]``."""
    i_nh, i_v, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # 64-bit: st_m's offsets
    n = i_nh // H
    h = i_nh % H
    p = tl.load(pos + n).to(tl.int32)
    new = L + p % L
    W = 2 * L
    p_s = s + i_nh * (W + S)
    # the softmax's max and denominator over all 2L + S scores (chunks of BR, online)
    b_mx = tl.full([], NEG, tl.float32)
    b_l = tl.zeros([], tl.float32)
    for t0 in range(0, W + S, BR):
        o_t = t0 + tl.arange(0, BR)
        b_s = tl.load(p_s + o_t, mask=o_t < W + S, other=float("-inf"))
        m_new = tl.maximum(b_mx, tl.max(b_s, 0))
        b_l = b_l * tl.exp(b_mx - m_new) + tl.sum(tl.exp(b_s - m_new), 0)
        b_mx = m_new
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    c_lo = i_c * CH  # this split's keys: visible window slots [w_lo, w_hi), codes [s_lo, s_hi)
    w_lo = tl.maximum(tl.minimum(c_lo, W), tl.where(p >= L, 0, L))
    w_hi = tl.minimum(c_lo + CH, new + 1)
    s_lo, s_hi = tl.maximum(c_lo - W, 0), tl.minimum(tl.maximum(c_lo + CH - W, 0), S)
    b_a = tl.zeros([BN, BV], tl.float32)  # summed over the slots once, after the loop
    for j0 in range(w_lo, w_hi, BN):
        o_j = j0 + tl.arange(0, BN)
        m_j = o_j < w_hi
        b_p = tl.exp(tl.load(p_s + o_j, mask=m_j, other=float("-inf")) - b_mx)
        b_w = tl.load(st_v + ((n * W + o_j[:, None]) * H + h) * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :],
                      other=0.0).to(tl.float32)  # [BN, BV]
        b_a += b_p[:, None] * b_w
    b_o = tl.sum(b_a, 0)
    b_a2 = tl.zeros([BS, BV], tl.float32)
    for s0 in range(s_lo, s_hi, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < s_hi
        b_p = tl.exp(tl.load(p_s + W + o_s, mask=m_s, other=float("-inf")) - b_mx)  # 0 for a count of 0
        b_w = tl.load(st_m + (i_nh * S + o_s[:, None]) * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :],
                      other=0.0)  # [BS, BV] fp32
        b_a2 += b_p[:, None] * b_w
    b_o = (b_o + tl.sum(b_a2, 0)) / b_l  # b_l > 0: the token's own slot is always visible
    if SPLIT:
        tl.store(part_o + (i_nh * NSPLIT + i_c) * V + o_v, b_o, mask=m_v)
    else:
        tl.store(o + i_nh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@triton.jit
def vq_decode_combine_kernel(part_o, o, NSPLIT, V: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr):
    """Grid ``(N * H, cdiv(V, BV))``: the splits' shares of the output (each already normalised by the whole
    row's softmax) summed; ``BC >= NSPLIT``."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, BC)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_a = tl.load(part_o + (i_nh * NSPLIT + o_c[:, None]) * V + o_v[None, :],
                  mask=(o_c < NSPLIT)[:, None] & m_v[None, :], other=0.0)  # [BC, BV]
    tl.store(o + i_nh * V + o_v, tl.sum(b_a, 0).to(o.dtype.element_ty), mask=m_v)


@triton.jit
def vq_decode_merge_kernel(st_z, st_v, st_c, st_m, pos, L, S, H: tl.constexpr, V: tl.constexpr, BS: tl.constexpr,
                           BJ: tl.constexpr, BV: tl.constexpr):
    """Grid ``(N * H, cdiv(S, BS))``: at a block end (``(pos + 1) % L == 0``) with a previous block (``pos >= L``),
    the cache of codes ``[BS]`` absorbs the previous block (window slots ``[0, L)``)."""
    i_nh, i_s = tl.program_id(0), tl.program_id(1)
    n = (i_nh // H).to(tl.int64)
    h = i_nh % H
    p = tl.load(pos + n)
    if ((p + 1) % L == 0) & (p >= L):
        row = n * 2 * L
        o_s = i_s * BS + tl.arange(0, BS)
        m_s = o_s < S
        b_n = tl.zeros([BS], tl.float32)  # keys of the previous block per code
        for j0 in range(0, L, BJ):
            o_j = j0 + tl.arange(0, BJ)
            b_z = tl.load(st_z + (row + o_j) * H + h, mask=o_j < L, other=-1)
            b_n += tl.sum((b_z[None, :] == o_s[:, None]).to(tl.float32), 1)
        b_c = tl.load(st_c + i_nh * S + o_s, mask=m_s, other=0.0)
        tot = b_c + b_n
        d = tl.where(tot > 0, tot, 1.0)
        wa, wb = b_c / d, b_n / d  # seed Code 2: count-weighted means (state.merge)
        nb = tl.where(b_n > 0, b_n, 1.0)
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m_v = o_v < V
            b_u = tl.zeros([BS, BV], tl.float32)
            for j0 in range(0, L, BJ):
                o_j = j0 + tl.arange(0, BJ)
                m_j = o_j < L
                b_z = tl.load(st_z + (row + o_j) * H + h, mask=m_j, other=-1)
                b_hot = (b_z[None, :] == o_s[:, None]).to(tl.float32)  # [BS, BJ]
                b_w = tl.load(st_v + ((row + o_j[:, None]) * H + h) * V + o_v[None, :],
                              mask=m_j[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BJ, BV]
                b_u += tl.dot(b_hot, b_w, input_precision="ieee")
            p_m = st_m + (i_nh * S + o_s[:, None]) * V + o_v[None, :]
            b_m = tl.load(p_m, mask=m_s[:, None] & m_v[None, :], other=0.0)
            tl.store(p_m, wa[:, None] * b_m + wb[:, None] * (b_u / nb[:, None]), mask=m_s[:, None] & m_v[None, :])
        tl.store(st_c + i_nh * S + o_s, tot, mask=m_s)


@triton.jit
def vq_decode_shift_kernel(st_k, st_v, st_z, pos, L, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BJ: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Grid ``(N * H, cdiv(L, BJ))``: at a block end, slots ``[L, 2L)`` of slot tile ``[BJ]`` move to ``[0, L)``
    and are zeroed (each program owns its slot pairs)."""
    i_nh, i_j = tl.program_id(0), tl.program_id(1)
    n = (i_nh // H).to(tl.int64)
    h = i_nh % H
    p = tl.load(pos + n)
    if (p + 1) % L == 0:
        row = n * 2 * L
        o_j = i_j * BJ + tl.arange(0, BJ)
        m_j = o_j < L
        src, dst = (row + L + o_j) * H + h, (row + o_j) * H + h  # [BJ] slot-head rows
        b_z = tl.load(st_z + src, mask=m_j, other=0)
        tl.store(st_z + dst, b_z, mask=m_j)
        tl.store(st_z + src, tl.zeros_like(b_z), mask=m_j)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m = m_j[:, None] & (o_k < K)[None, :]
            b_k = tl.load(st_k + src[:, None] * K + o_k[None, :], mask=m, other=0.0)
            tl.store(st_k + dst[:, None] * K + o_k[None, :], b_k, mask=m)
            tl.store(st_k + src[:, None] * K + o_k[None, :], tl.zeros_like(b_k), mask=m)
        for v0 in range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            m = m_j[:, None] & (o_v < V)[None, :]
            b_w = tl.load(st_v + src[:, None] * V + o_v[None, :], mask=m, other=0.0)
            tl.store(st_v + dst[:, None] * V + o_v[None, :], b_w, mask=m)
            tl.store(st_v + src[:, None] * V + o_v[None, :], tl.zeros_like(b_w), mask=m)


def fusable(q: torch.Tensor, state) -> bool:
    """The kernels' inputs: fp16 / bf16 / fp32, an fp32 cache, keys up to 256 wide."""
    return (q.dtype in (torch.float16, torch.bfloat16, torch.float32) and state.k_hat.shape[-1] <= 256
            and state.cache_count.dtype == torch.float32 and state.cache_mean.dtype == torch.float32)


def triton_decode_step_(q, k_hat, codes, v, codebook, state, bias=None, rel_bias=None, splits=None,
                        launch: VQLaunch | None = None) -> torch.Tensor:
    """:func:`lintime.ops.vq.decode.vq_decode_step_` on the kernels above (arguments checked there; fp16 / bf16 /
    fp32 inputs with an fp32 cache, keys up to 256 wide: :func:`fusable`).  ``splits``: the values kernel's key
    splits (``None``: :meth:`.launch.VQLaunch.decode_splits`'s rule; 1: one program per value tile walks every
    key, no combine; tests).  Tiles, splits and warps: ``launch`` (``None``: :func:`.launch.default_launch`; see
    :meth:`~.launch.VQLaunch.decode_tiles`)."""
    N, L2, H, K = state.k_hat.shape
    V, S, L = state.v.shape[-1], state.cache_count.shape[-1], L2 // 2
    check_device("vq_decode_step_", q)
    for name in ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos"):
        if not getattr(state, name).is_contiguous():
            raise ValueError(f"vq_decode_step_: the fused step writes state.{name} in place; it must be contiguous")
    cfg = launch or default_launch(K, V, q.dtype)
    t = cfg.decode_tiles(K, V)
    o = q.new_empty(N, H, V)
    nv, keys = cdiv(V, t["BV"]), 2 * L + S
    ch, ns = cfg.decode_splits(N * H * nv, keys, t["BN"], q.device, splits)
    scores = q.new_empty(N * H, keys, dtype=torch.float32)
    part_o = q.new_empty(N * H, ns, V, dtype=torch.float32) if ns > 1 else None
    if N * H:
        vq_decode_scores_kernel[(N * H, cdiv(keys, t["BT"]))](
            q.contiguous(), k_hat.contiguous(), codes.contiguous(), v.contiguous(), codebook.contiguous(),
            None if bias is None else bias.contiguous(), None if rel_bias is None else rel_bias[0].contiguous(),
            None if rel_bias is None else rel_bias[1].contiguous(), state.k_hat, state.v, state.codes,
            state.cache_count, state.pos, scores, L, S, H=H, K=K, V=V, BT=t["BT"], BK=t["BK"], BV=t["BV"],
            HAS_BIAS=bias is not None, HAS_REL=rel_bias is not None, num_warps=cfg.dec_warps_scores,
        )
        vq_decode_values_kernel[(N * H, nv, ns)](
            scores, state.v, state.cache_mean, state.pos, o, part_o, L, S, ch, ns, H=H, V=V, BN=t["BN"],
            BS=t["BS"], BV=t["BV"], BR=t["BR"], SPLIT=ns > 1, num_warps=cfg.dec_warps_values,
        )
        if ns > 1:
            vq_decode_combine_kernel[(N * H, nv)](part_o, o, ns, V=V, BC=block(ns), BV=t["BV"])
        vq_decode_merge_kernel[(N * H, cdiv(S, t["BSM"]))](
            state.codes, state.v, state.cache_count, state.cache_mean, state.pos, L, S, H=H, V=V, BS=t["BSM"],
            BJ=t["BSM"], BV=t["BVM"], num_stages=cfg.dec_stages_merge, num_warps=cfg.dec_warps_merge,
        )
        vq_decode_shift_kernel[(N * H, cdiv(L, t["BJ"]))](
            state.k_hat, state.v, state.codes, state.pos, L, H=H, K=K, V=V, BJ=t["BJ"], BK=t["BK"], BV=t["BV"],
        )
    state.pos.add_(1)
    return o
