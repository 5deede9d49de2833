"""One token's vector quantisation (seed Eq. 5, and Eq. 6's forward value) in one kernel for a decoding step:
``vq_quantize_kernel`` -- per (sequence, head), the distances ``||c_s||^2 - 2 k . c_s`` to every codeword in fp32
(``||k||^2`` does not change the argmin), their first minimum and that codeword written as ``k_hat`` in ``k``'s
dtype.  Replaces the layer's cast, distance GEMM, argmin, gather and cast (five launches per layer and token).
Inference only: no gradient, no commitment loss or EMA statistics (training runs the layer's PyTorch path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.kernel_launch import block, check_device, interpreting, next_pow2


@triton.jit
def vq_quantize_kernel(k, cb, c2, codes, k_hat, S, H: tl.constexpr, K: tl.constexpr, BS: tl.constexpr,
                       BK: tl.constexpr):
    """Grid ``(N * H,)``.  ``k`` ``[N, H, K]``, ``cb`` ``[H, S, K]`` fp32, ``c2`` ``[H, S]`` fp32 (``||c||^2``);
    writes ``codes`` ``[N, H]`` (int64) and ``k_hat`` ``[N, H, K]``."""
    i_nh = tl.program_id(0)
    h = i_nh % H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = tl.load(k + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    best = tl.full([], float("inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < S
        b_c = tl.load(cb + (h * S + o_s[:, None]) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_d = tl.load(c2 + h * S + o_s, mask=m_s, other=0.0) - 2.0 * tl.sum(b_c * b_k[None, :], 1)
        b_d = tl.where(m_s, b_d, float("inf"))
        d_min = tl.min(b_d, 0)
        i_min = tl.min(tl.where(b_d == d_min, o_s, S), 0)  # the first of equal distances, as torch.argmin
        better = d_min < best  # strictly: an earlier tile keeps a tie
        best_i = tl.where(better, i_min, best_i)
        best = tl.where(better, d_min, best)
    tl.store(codes + i_nh, best_i.to(tl.int64))
    b_z = tl.load(cb + (h * S + best_i) * K + o_k, mask=m_k, other=0.0)
    tl.store(k_hat + i_nh * K + o_k, b_z.to(k_hat.dtype.element_ty), mask=m_k)


def quantize_step(k: torch.Tensor, codebook: torch.Tensor, sq_norms: torch.Tensor):
    """``k`` ``[N, H, K]``, ``codebook`` ``[H, S, K]`` fp32, ``sq_norms`` ``||codebook||^2`` (``H * S`` values, fp32)
    -> ``codes [N, H]`` (int64, the first nearest codeword) and ``k_hat [N, H, K]`` (that codeword in ``k``'s
    dtype).  No gradient.  Tiles of ``BS`` codes x ``K`` (16 codes under the interpreter): a step is latency-bound
    (one program per sequence and head walks the whole codebook), so wide tiles of 16k elements (128 codes at K = 128,
    8 warps) take 4 steps for 512 codes where 32-code tiles took 16 -- 29 us per layer and token with 32-code tiles in
    vq-base's decode profile (H200, 2026-11-27, ``benchmarks/profile_decode.py``)."""
    check_device("quantize_step", k)
    N, H, K = k.shape
    S = codebook.shape[1]
    codes = torch.empty(N, H, dtype=torch.long, device=k.device)
    k_hat = torch.empty_like(k)
    BK = block(K)
    BS = 16 if interpreting() else min(next_pow2(S), max(32, 16384 // BK))
    warps = 4 if interpreting() else max(4, min(8, BS * BK // 2048))
    if N * H:
        vq_quantize_kernel[(N * H,)](k.contiguous(), codebook.contiguous(), sq_norms.contiguous(), codes, k_hat, S,
                                    H=H, K=K, BS=BS, BK=BK, num_warps=warps)
    return codes, k_hat
