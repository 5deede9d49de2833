"""The fused Transformer-VQ decoding step (:func:`lintime.ops.vq.decode.vq_decode_step_`, ``backend="triton"``):
three kernels and the position increment, every one a fixed-shape launch that reads the positions on the device
(no host read), so a CUDA graph replays the step.

* ``vq_decode_attn_kernel`` -- per (sequence, head, value tile): writes the token's key, code and value tile into
  window slot ``L + pos % L``, then one online softmax over the window slots (causal: slots ``[0, L)`` once
  ``pos >= L``, slots ``[L, L + pos % L]``; the bias added, or formed from a relative table: ``qv . r[m]`` at
  distance ``m``) and the ``S`` codes (``q . codebook + log count``,
  the fp32 running means as values); the token's own slot is scored and read from the registers that hold it
  (other programs of the row are writing it).  When a step has few programs (small batches) the keys are split
  over more (flash-decoding): each split's partial softmax sums go to ``vq_decode_combine_kernel``, which merges
  them into the output;
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
from lintime.ops.vq.triton.launch import default_launch

NEG = tl.constexpr(-1.0e30)  # the running max's start: finite, so a tile with no visible slot gives exp(-inf - NEG) = 0


@triton.jit
def _online_softmax(b_mx, b_l, b_acc, b_s, b_w):
    """One block of keys into the running softmax: scores ``b_s [B]`` (-inf: masked), values ``b_w [B, BV]``;
    the running max ``b_mx``, denominator ``b_l`` and numerator ``b_acc [BV]`` rescaled to the new max."""
    m_new = tl.maximum(b_mx, tl.max(b_s, 0))
    alpha = tl.exp(b_mx - m_new)
    b_p = tl.exp(b_s - m_new)
    return m_new, b_l * alpha + tl.sum(b_p, 0), b_acc * alpha + tl.sum(b_p[:, None] * b_w, 0)


@triton.jit
def vq_decode_attn_kernel(q, kn, zn, vn, cb, bias, qv, rt, st_k, st_v, st_z, st_c, st_m, pos, o, part_ml, part_o,
                          L, S, CH, NSPLIT, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
                          BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_REL: tl.constexpr, SPLIT: tl.constexpr):
    """Grid ``(N * H, cdiv(V, BV), NSPLIT)``.  ``q``, ``kn`` ``[N, H, K]``, ``zn`` ``[N, H]``, ``vn`` ``[N, H, V]``,
    ``cb`` ``[H, S, K]``, ``bias`` ``[N, H, 2L]``, the relative bias ``qv [N, H, K]`` and ``rt [L + 1, H, K]``; state
    ``st_k [N, 2L, H, K]``, ``st_v [N, 2L, H, V]``, ``st_z [N, 2L, H]``, ``st_c [N, H, S]``, ``st_m [N, H, S, V]``,
    ``pos [N]``; ``o [N, H, V]`` in ``q``'s dtype.  Split ``i`` takes keys ``[i CH, (i + 1) CH)`` of the window
    slots followed by the codes; with ``SPLIT`` it writes its running max and sum to ``part_ml [N H, NSPLIT, 2]``
    and its unnormalised sum to ``part_o [N H, NSPLIT, V]`` (fp32) for :func:`vq_decode_combine_kernel`, else
    ``o``."""
    i_nh, i_v, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = (i_nh // H).to(tl.int64)
    h = i_nh % H
    p = tl.load(pos + n)
    r = p % L
    new = L + r  # the token's window slot
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_q = tl.load(q + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_kn = tl.load(kn + i_nh * K + o_k, mask=m_k, other=0.0)
    b_vn = tl.load(vn + i_nh * V + o_v, mask=m_v, other=0.0)
    row = n * 2 * L  # the sequence's first window slot
    if i_c == 0:
        tl.store(st_v + ((row + new) * H + h) * V + o_v, b_vn.to(st_v.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(st_k + ((row + new) * H + h) * K + o_k, b_kn.to(st_k.dtype.element_ty), mask=m_k)
            tl.store(st_z + (row + new) * H + h, tl.load(zn + i_nh).to(st_z.dtype.element_ty))
    c_lo = i_c * CH  # this split's keys: window slots [w_lo, w_hi), codes [s_lo, s_hi)
    w_lo, w_hi = tl.minimum(c_lo, 2 * L), tl.minimum(c_lo + CH, 2 * L)
    s_lo, s_hi = tl.maximum(c_lo - 2 * L, 0), tl.minimum(tl.maximum(c_lo + CH - 2 * L, 0), S)
    s_new = tl.sum(b_q * b_kn.to(tl.float32), 0)
    b_vn = b_vn.to(tl.float32)
    if HAS_REL:
        b_qv = tl.load(qv + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    b_mx = tl.full([], NEG, tl.float32)
    b_l = tl.zeros([], tl.float32)
    b_acc = tl.zeros([BV], tl.float32)
    for j0 in range(w_lo, w_hi, BN):  # the window (seed Eq. 29-30)
        o_j = j0 + tl.arange(0, BN)
        m_j = o_j < w_hi
        vis = m_j & tl.where(o_j < L, p >= L, o_j <= new)
        b_k = tl.load(st_k + ((row + o_j[:, None]) * H + h) * K + o_k[None, :], mask=m_j[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)  # [BN, BK]
        b_s = tl.where(o_j == new, s_new, tl.sum(b_k * b_q[None, :], 1))
        if HAS_BIAS:
            b_s += tl.load(bias + i_nh * 2 * L + o_j, mask=m_j, other=0.0).to(tl.float32)
        if HAS_REL:  # slot j is at distance new - j from the token; none beyond L (seed Theorem 3.6)
            m_r = new - o_j
            ok = m_j & (m_r >= 0) & (m_r <= L)
            b_r = tl.load(rt + (tl.where(ok, m_r, 0)[:, None] * H + h) * K + o_k[None, :],
                          mask=ok[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BN, BK]
            b_s += tl.sum(b_r * b_qv[None, :], 1)
        b_s = tl.where(vis, b_s, float("-inf"))
        b_w = tl.load(st_v + ((row + o_j[:, None]) * H + h) * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :],
                      other=0.0).to(tl.float32)  # [BN, BV]
        b_w = tl.where((o_j == new)[:, None], b_vn[None, :], b_w)
        b_mx, b_l, b_acc = _online_softmax(b_mx, b_l, b_acc, b_s, b_w)
    for s0 in range(s_lo, s_hi, BS):  # the cache (seed Eq. 28, Remark 3.9)
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < s_hi
        b_c = tl.load(st_c + i_nh * S + o_s, mask=m_s, other=0.0)
        b_cb = tl.load(cb + (h * S + o_s[:, None]) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :],
                       other=0.0).to(tl.float32)  # [BS, BK]
        b_s = tl.sum(b_cb * b_q[None, :], 1) + tl.log(tl.where(b_c > 0, b_c, 1.0))
        b_s = tl.where(m_s & (b_c > 0), b_s, float("-inf"))
        b_w = tl.load(st_m + (i_nh * S + o_s[:, None]) * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :],
                      other=0.0)  # [BS, BV] fp32
        b_mx, b_l, b_acc = _online_softmax(b_mx, b_l, b_acc, b_s, b_w)
    if SPLIT:
        tl.store(part_o + (i_nh * NSPLIT + i_c) * V + o_v, b_acc, mask=m_v)
        if i_v == 0:
            tl.store(part_ml + (i_nh * NSPLIT + i_c) * 2, b_mx)
            tl.store(part_ml + (i_nh * NSPLIT + i_c) * 2 + 1, b_l)
    else:  # b_l > 0: the token's own slot is always visible
        tl.store(o + i_nh * V + o_v, (b_acc / b_l).to(o.dtype.element_ty), mask=m_v)


@triton.jit
def vq_decode_combine_kernel(part_ml, part_o, o, NSPLIT, V: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr):
    """Grid ``(N * H, cdiv(V, BV))``: the splits' partial softmax sums merged (flash-decoding): ``o = sum_i
    exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i`` with ``M`` the largest running max; ``BC >= NSPLIT``."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, BC)
    m_c = o_c < NSPLIT
    b_m = tl.load(part_ml + (i_nh * NSPLIT + o_c) * 2, mask=m_c, other=NEG)
    b_l = tl.load(part_ml + (i_nh * NSPLIT + o_c) * 2 + 1, mask=m_c, other=0.0)
    b_w = tl.exp(b_m - tl.max(b_m, 0))  # [BC]; 0 for a split that saw no key (its max is NEG)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_a = tl.load(part_o + (i_nh * NSPLIT + o_c[:, None]) * V + o_v[None, :], mask=m_c[:, None] & m_v[None, :],
                  other=0.0)  # [BC, BV]
    b_o = tl.sum(b_w[:, None] * b_a, 0) / tl.sum(b_w * b_l, 0)
    tl.store(o + i_nh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


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


def triton_decode_step_(q, k_hat, codes, v, codebook, state, bias=None, rel_bias=None, splits=None) -> torch.Tensor:
    """:func:`lintime.ops.vq.decode.vq_decode_step_` on the kernels above (arguments checked there; fp16 / bf16 /
    fp32 inputs with an fp32 cache, keys up to 256 wide: :func:`fusable`).  ``splits``: the attention's key
    splits (``None``: :meth:`.launch.VQLaunch.decode_splits`'s rule; 1: one program walks every key, no combine;
    tests).  Tiles, splits and warps: :class:`.launch.VQLaunch` (:meth:`~.launch.VQLaunch.decode_tiles`)."""
    N, L2, H, K = state.k_hat.shape
    V, S, L = state.v.shape[-1], state.cache_count.shape[-1], L2 // 2
    check_device("vq_decode_step_", q)
    for name in ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos"):
        if not getattr(state, name).is_contiguous():
            raise ValueError(f"vq_decode_step_: the fused step writes state.{name} in place; it must be contiguous")
    cfg = default_launch(K, V, q.dtype)
    t = cfg.decode_tiles(K, V)
    o = q.new_empty(N, H, V)
    nv = cdiv(V, t["BV"])
    ch, ns = cfg.decode_splits(N * H * nv, 2 * L + S, t["BN"], q.device, splits)
    part_ml = q.new_empty(N * H, ns, 2, dtype=torch.float32) if ns > 1 else None
    part_o = q.new_empty(N * H, ns, V, dtype=torch.float32) if ns > 1 else None
    if N * H:
        vq_decode_attn_kernel[(N * H, nv, ns)](
            q.contiguous(), k_hat.contiguous(), codes.contiguous(), v.contiguous(), codebook.contiguous(),
            None if bias is None else bias.contiguous(), None if rel_bias is None else rel_bias[0].contiguous(),
            None if rel_bias is None else rel_bias[1].contiguous(), state.k_hat, state.v, state.codes,
            state.cache_count, state.cache_mean, state.pos, o, part_ml, part_o, L, S, ch, ns, H=H, K=K, V=V,
            BN=t["BN"], BS=t["BS"], BK=t["BK"], BV=t["BV"], HAS_BIAS=bias is not None, HAS_REL=rel_bias is not None,
            SPLIT=ns > 1,
        )
        if ns > 1:
            vq_decode_combine_kernel[(N * H, nv)](part_ml, part_o, o, ns, V=V, BC=block(ns), BV=t["BV"])
        vq_decode_merge_kernel[(N * H, cdiv(S, t["BSM"]))](
            state.codes, state.v, state.cache_count, state.cache_mean, state.pos, L, S, H=H, V=V, BS=t["BSM"],
            BJ=t["BSM"], BV=t["BVM"], num_stages=cfg.dec_stages_merge, num_warps=cfg.dec_warps_merge,
        )
        vq_decode_shift_kernel[(N * H, cdiv(L, t["BJ"]))](
            state.k_hat, state.v, state.codes, state.pos, L, H=H, K=K, V=V, BJ=t["BJ"], BK=t["BK"], BV=t["BV"],
        )
    state.pos.add_(1)
    return o
