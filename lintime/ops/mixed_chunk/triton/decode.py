"""One FLASH decoding step in three Triton kernels, updating a :class:`~lintime.ops.MixedChunkState` in place.

Notation: ``N`` sequences (one token each), ``S`` key width, ``HD = S / 2`` (RoPE's two halves), ``E`` value
width, ``C`` chunk size, ``W = 2E + S`` the projection's width; ``BC`` chunk slots per block, ``BE`` value columns
per program, ``BS`` (a power of two >= ``S``) key columns.

* :func:`decode_scores_kernel`, grid ``(N, cdiv(C, BC))``: program ``(n, i_c)`` reads row ``n`` of the projection
  ``h``, forms the four heads (silu, scale + offset, RoPE at the token's position -- as ``gau_heads``, rounded to
  the buffers' dtype) and scores its block of slots ``0..fill`` against ``q_quad``, the new token at slot ``fill``
  (relu^2 with the Toeplitz bias, seed Eq. 6), into an fp32 scratch ``w [N, C]``; the program holding slot
  ``fill`` writes the two new keys there, program 0 writes ``q_lin`` into a scratch ``ql [N, BS]``.  Each
  sequence's keys are read and scored once.
* :func:`decode_values_kernel`, grid ``(N, cdiv(E, BE))``: program ``(n, i_e)`` sums ``w . v`` over slots
  ``0..fill`` for its ``BE`` columns, adds the linear part ``q_lin . kv / N`` (seed Eq. 8) and stores ``u * a``
  (seed Code 8's gate).  It writes the new ``v`` columns at slot ``fill``; when the token completes its chunk it
  adds ``k_lin^T v`` over the chunk to its ``kv`` columns and zeroes its ``v`` columns instead.
* :func:`decode_advance_kernel`, grid ``(N,)``, last: ``fill + 1``, or at a chunk's completion ``fill = 0``,
  ``count += C`` and the key buffers zeroed (the values kernel reads ``k_lin`` at completion).

Three launches, fixed shapes, no host read: a CUDA graph captures them.  The arithmetic is the recurrent form's
(:func:`lintime.ops.mixed_chunk.recurrent.decode_one_token`): fp32 everywhere, the heads, ``a`` and ``u * a``
rounded to the input dtype where the layer's eager path rounds them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import cdiv, next_pow2
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch, default_launch
from lintime.ops.utils import rope_inv_freq

NORMS = {"tokens": 0, "chunk": 1, "none": 2}


@triton.jit
def decode_scores_kernel(
    h, gamma, beta, pos, freq, bias, k_quad, k_lin, fill, w, ql,
    scale, W, pos_stride,
    S: tl.constexpr, HD: tl.constexpr, C: tl.constexpr, HAS_BIAS: tl.constexpr, BS: tl.constexpr,
    BC: tl.constexpr,
):
    """Program ``(n, i_c)``: the token's four heads, its keys into slot ``fill`` (program of that slot), its
    ``q_lin`` into ``ql[n]`` (program 0), and the relu^2 scores of slots ``i_c * BC ..`` up to ``fill`` into
    ``w[n]``.  ``h [N, W]``, ``k_quad / k_lin [N, C, S]``, ``fill [N]`` int64, ``pos`` int (stride
    ``pos_stride``), ``freq [HD]`` fp32, ``bias [2C - 1]``, ``w [N, C]`` and ``ql [N, BS]`` fp32."""
    i_n, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    f = tl.load(fill + i_n).to(tl.int32)
    c0 = i_c * BC
    if c0 <= f:
        DT = k_quad.dtype.element_ty
        p_h = h + i_n * W
        # the four heads q_quad, k_quad, q_lin, k_lin as rows of [4, BS] tiles (gau_heads for one token): feature
        # j pairs with j -+ HD in RoPE's two halves (seed Code 3), x1 cos - x2 sin in the first, x2 cos + x1 sin in
        # the second; gamma and beta rounded to DT first (ScaleOffset's rule), each head rounded to DT once
        o_s = tl.arange(0, BS)
        m_s = o_s < S
        first = o_s < HD
        o_p = tl.where(first, o_s + HD, o_s - HD)  # the partner feature
        o_hd = tl.arange(0, 4)[:, None] * S
        z = tl.load(p_h + (W - S) + o_s, mask=m_s, other=0.).to(tl.float32)
        zp = tl.load(p_h + (W - S) + o_p, mask=m_s, other=0.).to(tl.float32)
        z, zp = z / (1.0 + tl.exp(-z)), zp / (1.0 + tl.exp(-zp))  # silu (seed Code 6)
        m_hs = m_s[None, :] & (o_hd >= 0)
        q = (z[None, :] * tl.load(gamma + o_hd + o_s[None, :], mask=m_hs, other=0.).to(DT).to(tl.float32)
             + tl.load(beta + o_hd + o_s[None, :], mask=m_hs, other=0.).to(DT).to(tl.float32))  # seed Code 6
        qp = (zp[None, :] * tl.load(gamma + o_hd + o_p[None, :], mask=m_hs, other=0.).to(DT).to(tl.float32)
              + tl.load(beta + o_hd + o_p[None, :], mask=m_hs, other=0.).to(DT).to(tl.float32))
        b_a = tl.load(pos + i_n * pos_stride).to(tl.float32) * tl.load(freq + o_s % HD, mask=m_s, other=0.)
        sign = tl.where(first, -1.0, 1.0)
        r = (q * tl.cos(b_a)[None, :] + (sign[None, :] * qp) * tl.sin(b_a)[None, :]).to(DT).to(tl.float32)
        b_qq = tl.sum(tl.where(o_hd == 0, r, 0.), 0)  # [BS] each
        b_kq = tl.sum(tl.where(o_hd == S, r, 0.), 0)

        o_c = c0 + tl.arange(0, BC)
        m_c = o_c <= f
        new = (o_c == f)[:, None]
        p_kq = k_quad + i_n * C * S
        if f < c0 + BC:  # this block holds slot `fill`: the new keys go there (cleared at a chunk's completion)
            tl.store(p_kq + f * S + o_s, b_kq.to(DT), mask=m_s)
            b_kl = tl.sum(tl.where(o_hd == 3 * S, r, 0.), 0)
            tl.store(k_lin + i_n * C * S + f * S + o_s, b_kl.to(DT), mask=m_s)
        if i_c == 0:
            tl.store(ql + i_n * BS + o_s, tl.sum(tl.where(o_hd == 2 * S, r, 0.), 0))
        # relu^2 scores with the Toeplitz bias (seed Eq. 6, causal); the new token's key from registers
        b_k = tl.where(new, b_kq[None, :], tl.load(p_kq + o_c[:, None] * S + o_s[None, :],
                                                   mask=m_c[:, None] & m_s[None, :], other=0.).to(tl.float32))
        b_s = tl.sum(b_k * b_qq[None, :], 1) * scale  # [BC]
        if HAS_BIAS:
            b_s += tl.load(bias + (f - o_c + C - 1), mask=m_c, other=0.).to(tl.float32)  # b[i - j]
        b_s = tl.maximum(b_s, 0.)
        tl.store(w + i_n * C + o_c, b_s * b_s, mask=m_c)  # slots 0..fill: inside the chunk


@triton.jit
def decode_values_kernel(
    h, kv, count, k_lin, v, fill, w, ql, out, E, W,
    S: tl.constexpr, C: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr, BS: tl.constexpr,
    BC: tl.constexpr, BE: tl.constexpr,
):
    """``out[n, cols] = u * (quad + lin / N)`` for program ``(n, i_e)``'s ``BE`` columns, from the scores ``w[n]``
    and ``q_lin`` ``ql[n]`` of :func:`decode_scores_kernel`; the new ``v`` columns into slot ``fill``, or when the
    token completes its chunk ``k_lin^T v`` over the chunk added to its ``kv`` columns and its ``v`` columns zeroed.
    ``kv [N, S, E]`` fp32, ``v [N, C, E]``, ``count [N]`` int64."""
    i_n, i_e = tl.program_id(0).to(tl.int64), tl.program_id(1)
    DT = v.dtype.element_ty
    p_h = h + i_n * W
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    b_u = tl.load(p_h + o_e, mask=m_e, other=0.).to(tl.float32)
    b_u = (b_u / (1.0 + tl.exp(-b_u))).to(DT).to(tl.float32)
    b_vn = tl.load(p_h + E + o_e, mask=m_e, other=0.).to(tl.float32)
    b_vn = (b_vn / (1.0 + tl.exp(-b_vn))).to(DT)

    f = tl.load(fill + i_n).to(tl.int32)
    full = f == C - 1  # this token completes its chunk
    p_v = v + i_n * C * E
    if f != C - 1:  # the new token into slot `fill` (a completed chunk's buffers are cleared instead)
        tl.store(p_v + f * E + o_e, b_vn, mask=m_e)

    # quadratic part over slots 0..fill; at completion also k_lin^T v of the chunk (slot `fill`'s keys stored by
    # the scores kernel)
    b_o = tl.zeros([BE], dtype=tl.float32)
    b_d = tl.zeros([BS, BE], dtype=tl.float32)
    for c0 in range(0, f + 1, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c <= f
        new = (o_c == f)[:, None]
        b_w = tl.load(w + i_n * C + o_c, mask=m_c, other=0.)
        b_v = tl.load(p_v + o_c[:, None] * E + o_e[None, :], mask=m_c[:, None] & m_e[None, :], other=0.)
        b_v = tl.where(new, b_vn[None, :], b_v)
        b_o += tl.sum(b_w[:, None] * b_v.to(tl.float32), 0)
        if full:
            b_l = tl.load(k_lin + i_n * C * S + o_c[:, None] * S + o_s[None, :], mask=m_c[:, None] & m_s[None, :],
                          other=0.)
            b_d = tl.dot(tl.trans(b_l), b_v, b_d, input_precision=PREC)  # [BS, BE]

    # linear part: the completed chunks (seed Eq. 8), normalised
    m_se = m_s[:, None] & m_e[None, :]
    p_kv = kv + i_n * S * E + o_s[:, None] * E + o_e[None, :]
    b_kv = tl.load(p_kv, mask=m_se, other=0.)
    b_lin = tl.sum(tl.load(ql + i_n * BS + o_s)[:, None] * b_kv, 0)
    if NORM == 0:  # 'tokens': an empty sum gives 0
        b_n = tl.load(count + i_n).to(tl.float32)
        b_lin = tl.where(b_n > 0, b_lin / tl.maximum(b_n, 1.), 0.)
    elif NORM == 1:  # 'chunk'
        b_lin = b_lin / C
    b_a = (b_o + b_lin).to(DT).to(tl.float32)
    tl.store(out + i_n * E + o_e, (b_u * b_a).to(out.dtype.element_ty), mask=m_e)

    if full:  # the chunk moves into the linear sum; this program's value columns start over
        tl.store(p_kv, b_kv + b_d, mask=m_se)
        tl.debug_barrier()  # every thread's loads of v above come before the zeros
        for c0 in range(0, C, BC):
            o_c = c0 + tl.arange(0, BC)
            tl.store(p_v + o_c[:, None] * E + o_e[None, :], tl.zeros([BC, BE], dtype=DT),
                     mask=(o_c < C)[:, None] & m_e[None, :])


@triton.jit
def decode_advance_kernel(count, k_quad, k_lin, fill, S, C: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr):
    """The counters of sequence ``n`` after its token; at a chunk's completion its key buffers zeroed."""
    i_n = tl.program_id(0).to(tl.int64)
    f = tl.load(fill + i_n)
    if f == C - 1:
        o_s = tl.arange(0, BS)
        for c0 in range(0, C, BC):
            o_c = c0 + tl.arange(0, BC)
            o = i_n * C * S + o_c[:, None] * S + o_s[None, :]
            m = (o_c < C)[:, None] & (o_s < S)[None, :]
            tl.store(k_quad + o, tl.zeros([BC, BS], dtype=k_quad.dtype.element_ty), mask=m)
            tl.store(k_lin + o, tl.zeros([BC, BS], dtype=k_lin.dtype.element_ty), mask=m)
        tl.store(count + i_n, tl.load(count + i_n) + C)
        tl.store(fill + i_n, tl.zeros_like(f))
    else:
        tl.store(fill + i_n, f + 1)


@functools.lru_cache(maxsize=32)
def _inv_freq(half: int, base: float, device: str) -> torch.Tensor:
    """RoPE's fp32 frequencies, the same tensor values as :func:`lintime.ops.utils.rope` (cached per shape: a
    captured step must not build it)."""
    return rope_inv_freq(half, base, torch.float32, device)


def triton_decode_step_(h, gamma, beta, positions, kv, count, k_quad, k_lin, v, fill, rel_bias, scale: float,
                        linear_norm: str, rope_base: float, launch: MixedChunkLaunch | None = None) -> torch.Tensor:
    """Launch the three kernels (arguments checked by :func:`lintime.ops.mixed_chunk_decode_step_`): ``h [N, W]``,
    the state's tensors as ``[N, S, E]`` / ``[N, C, S]`` / ``[N, C, E]`` / ``[N]`` (contiguous), ``rel_bias
    [2C - 1]`` or ``None``, ``positions [N]``.  Returns ``u * a`` ``[N, E]`` in ``h``'s dtype."""
    N, W = h.shape
    C, S = k_quad.shape[1], k_quad.shape[2]
    E = v.shape[2]
    cfg = launch or default_launch(S, E, h.dtype, C)
    BC, BE, warps = cfg.decode_tiles(N, E, h.device)
    score_warps = cfg.dec_warps_scores
    out = h.new_empty(N, E)
    if N == 0:
        return out
    hd = S // 2
    freq = _inv_freq(hd, float(rope_base), str(h.device))
    prec = "ieee" if h.dtype == torch.float32 else "tf32"
    bias = rel_bias if rel_bias is not None else kv  # a dummy pointer when there is no bias
    BS = max(16, next_pow2(S))
    w, ql = h.new_empty(N, C, dtype=torch.float32), h.new_empty(N, BS, dtype=torch.float32)
    decode_scores_kernel[(N, cdiv(C, BC))](
        h, gamma, beta, positions, freq, bias, k_quad, k_lin, fill, w, ql,
        float(scale), W, positions.stride(0),
        S=S, HD=hd, C=C, HAS_BIAS=rel_bias is not None, BS=BS, BC=BC, num_warps=score_warps,
    )
    decode_values_kernel[(N, cdiv(E, BE))](
        h, kv, count, k_lin, v, fill, w, ql, out, E, W,
        S=S, C=C, NORM=NORMS[linear_norm], PREC=prec, BS=BS, BC=BC, BE=BE, num_warps=warps,
    )
    decode_advance_kernel[(N,)](count, k_quad, k_lin, fill, S, C=C, BC=BC, BS=max(16, next_pow2(S)),
                                num_warps=warps)
    return out


__all__ = ["triton_decode_step_"]
