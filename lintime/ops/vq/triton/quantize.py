"""One token's vector quantisation (seed Eq. 5, and Eq. 6's forward value) for a decoding step:
``vq_quantize_kernel`` -- per (sequence, head) and chunk of the codes, the distances ``||c_s||^2 - 2 k . c_s`` to
every codeword in fp32 (``||k||^2`` does not change the argmin), their first minimum and that codeword written as
``k_hat`` in ``k``'s dtype (merged over the chunks by ``vq_quantize_pick_kernel``).  Replaces the layer's cast,
distance GEMM, argmin, gather and cast (five launches per layer and token).
Inference only: no gradient, no commitment loss or EMA statistics.

``vq_assign_kernel`` is the many-token form (a training call, a prefill): per tile of rows and head, the distances to
the codebook as tensor-core products in three TF32 passes (``tf32x3``: about fp32's accuracy), the running first
minimum over the code tiles, and the nearest codeword gathered in fp32 -- where the PyTorch path is a cast, an fp32
GEMM on the CUDA cores, the ``[N, S]`` distances written and read by an argmin, and a gather."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import block, cdiv, check_device, interpreting, next_pow2
from lintime.ops.vq.triton.launch import default_launch


@triton.jit
def _store_code(cb, codes, k_hat, i_nh, h, best_i, S, K: tl.constexpr, BK: tl.constexpr):
    """``codes[i_nh] = best_i`` and its codeword as ``k_hat[i_nh]`` in ``k_hat``'s dtype."""
    tl.store(codes + i_nh, best_i.to(tl.int64))
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_z = tl.load(cb + (h * S + best_i) * K + o_k, mask=m_k, other=0.0)
    tl.store(k_hat + i_nh * K + o_k, b_z.to(k_hat.dtype.element_ty), mask=m_k)


@triton.jit
def vq_quantize_kernel(k, cb, c2, codes, k_hat, part_d, part_i, S, CH, NSPLIT, H: tl.constexpr, K: tl.constexpr,
                       BS: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """Grid ``(N * H, NSPLIT)``.  ``k`` ``[N, H, K]``, ``cb`` ``[H, S, K]`` fp32, ``c2`` ``[H, S]`` fp32
    (``||c||^2``).  Program ``(i_nh, i_c)`` finds the first nearest of codes ``[i_c CH, (i_c + 1) CH)``; with
    ``SPLIT`` its distance goes to ``part_d [N H, NSPLIT]`` (fp32) and its index to ``part_i`` (int32) for
    :func:`vq_quantize_pick_kernel`, else (one chunk, all codes) it writes ``codes`` ``[N, H]`` (int64) and
    ``k_hat`` ``[N, H, K]``."""
    i_nh, i_c = tl.program_id(0), tl.program_id(1)
    h = i_nh % H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = tl.load(k + i_nh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    lo = i_c * CH
    hi = tl.minimum(S, lo + CH)
    best = tl.full([], float("inf"), tl.float32)
    best_i = tl.zeros([], tl.int32) + lo  # all distances inf: the chunk's first code, as torch.argmin
    for s0 in range(lo, hi, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < hi
        b_c = tl.load(cb + (h * S + o_s[:, None]) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_d = tl.load(c2 + h * S + o_s, mask=m_s, other=0.0) - 2.0 * tl.sum(b_c * b_k[None, :], 1)
        b_d = tl.where(m_s, b_d, float("inf"))
        d_min = tl.min(b_d, 0)
        i_min = tl.min(tl.where(b_d == d_min, o_s, S), 0)  # the first of equal distances, as torch.argmin
        better = d_min < best  # strictly: an earlier tile keeps a tie
        best_i = tl.where(better, i_min, best_i)
        best = tl.where(better, d_min, best)
    if SPLIT:
        tl.store(part_d + i_nh * NSPLIT + i_c, best)
        tl.store(part_i + i_nh * NSPLIT + i_c, best_i)
    else:
        _store_code(cb, codes, k_hat, i_nh, h, best_i, S, K, BK)


@triton.jit
def vq_quantize_pick_kernel(part_d, part_i, cb, codes, k_hat, S, NSPLIT, H: tl.constexpr, K: tl.constexpr,
                            BC: tl.constexpr, BK: tl.constexpr):
    """Grid ``(N * H,)``: the splits' first nearest merged (the least distance; among equal ones the least index,
    as ``torch.argmin``), written as ``codes`` and its codeword as ``k_hat``."""
    i_nh = tl.program_id(0)
    o_c = tl.arange(0, BC)
    m_c = o_c < NSPLIT
    b_d = tl.load(part_d + i_nh * NSPLIT + o_c, mask=m_c, other=float("inf"))
    b_i = tl.load(part_i + i_nh * NSPLIT + o_c, mask=m_c, other=S)
    best_i = tl.min(tl.where(b_d == tl.min(b_d, 0), b_i, S), 0)
    _store_code(cb, codes, k_hat, i_nh, i_nh % H, best_i, S, K, BK)


def quantize_step(k: torch.Tensor, codebook: torch.Tensor, sq_norms: torch.Tensor, splits: int | None = None):
    """``k`` ``[N, H, K]``, ``codebook`` ``[H, S, K]`` fp32, ``sq_norms`` ``||codebook||^2`` (``H * S`` values, fp32)
    -> ``codes [N, H]`` (int64, the first nearest codeword) and ``k_hat [N, H, K]`` (that codeword in ``k``'s
    dtype).  No gradient.

    A step is latency-bound: with few sequences one program per (sequence, head) walking the whole codebook leaves
    most SMs idle, whatever its tile (``docs/design/kernels.md``, Transformer-VQ).  So the codes are split over
    about two programs per SM (``vq_quantize_kernel``, 32-code chunks at batch 1) and a second kernel merges the
    splits' minima (flash-decoding's split, for an argmin); with enough sequences one kernel walks all codes in
    16k-element tiles (:meth:`.launch.VQLaunch.quantize_tiles`).
    ``splits``: the number of code chunks (``None``: that rule; 1: the one kernel; tests)."""
    check_device("quantize_step", k)
    N, H, K = k.shape
    S = codebook.shape[1]
    codes = torch.empty(N, H, dtype=torch.long, device=k.device)
    k_hat = torch.empty_like(k)
    if not N * H:
        return codes, k_hat
    k, codebook, sq_norms = k.contiguous(), codebook.contiguous(), sq_norms.contiguous()
    splits, CH, BS, BK, warps = default_launch(K, 0, k.dtype).quantize_tiles(N * H, S, K, k.device, splits)
    part_d = part_i = None
    if splits > 1:
        part_d = torch.empty(N * H, splits, dtype=torch.float32, device=k.device)
        part_i = torch.empty(N * H, splits, dtype=torch.int32, device=k.device)
    vq_quantize_kernel[(N * H, splits)](k, codebook, sq_norms, codes, k_hat, part_d, part_i, S, CH, splits, H=H, K=K,
                                        BS=BS, BK=BK, SPLIT=splits > 1, num_warps=warps)
    if splits > 1:
        vq_quantize_pick_kernel[(N * H,)](part_d, part_i, codebook, codes, k_hat, S, splits, H=H, K=K,
                                          BC=max(2, next_pow2(splits)), BK=BK)
    return codes, k_hat


@triton.jit
def vq_assign_kernel(k, cb, c2, codes, cz, N, S, H: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                     BS: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(cdiv(N, BM), H)``.  ``k`` ``[N, H, K]`` (any float dtype, read as fp32), ``cb`` ``[H, S, K]`` fp32,
    ``c2`` ``[H, S]`` fp32 (``||c||^2``) -> ``codes`` ``[N, H]`` int64 (the first nearest code: the least distance
    ``||c||^2 - 2 k . c``, then the least index, as ``torch.argmin``) and ``cz`` ``[N, H, K]`` fp32 (its codeword)."""
    i_m, h = tl.program_id(0), tl.program_id(1)
    o_m = i_m.to(tl.int64) * BM + tl.arange(0, BM)
    m_m = o_m < N
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_k = tl.load(k + (o_m[:, None] * H + h) * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    best = tl.full([BM], float("inf"), tl.float32)
    best_i = tl.zeros([BM], tl.int32)
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < S
        b_c = tl.load(cb + (h * S + o_s[:, None]) * K + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0.0)
        d = tl.load(c2 + h * S + o_s, mask=m_s, other=0.0)[None, :] - 2.0 * tl.dot(b_k, tl.trans(b_c),
                                                                                   input_precision=PREC)
        d = tl.where(m_s[None, :], d, float("inf"))
        d_min = tl.min(d, 1)
        i_min = tl.min(tl.where(d == d_min[:, None], o_s[None, :], S), 1)
        better = d_min < best  # strictly: an earlier tile keeps a tie
        best_i = tl.where(better, i_min, best_i)
        best = tl.where(better, d_min, best)
    tl.store(codes + o_m * H + h, best_i.to(tl.int64), mask=m_m)
    b_z = tl.load(cb + (h * S + best_i[:, None]) * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
    tl.store(cz + (o_m[:, None] * H + h) * K + o_k[None, :], b_z, mask=m_m[:, None] & m_k[None, :])


def assign_codes(k: torch.Tensor, codebook: torch.Tensor, sq_norms: torch.Tensor, tiles: tuple | None = None):
    """``k`` ``[N, H, K]``, ``codebook`` ``[H, S, K]`` fp32, ``sq_norms`` ``||codebook||^2`` (``H * S`` values, fp32)
    -> ``codes [N, H]`` (int64, the first nearest codeword) and ``c_z [N, H, K]`` (that codeword, fp32), by
    :func:`vq_assign_kernel`.  No gradient.  ``tiles``: ``(rows, codes, warps)`` per program (``None``:
    :class:`.launch.VQLaunch`'s ``asg_*``; the interpreter keeps its own)."""
    check_device("assign_codes", k)
    N, H, K = k.shape
    S = codebook.shape[1]
    codes = torch.empty(N, H, dtype=torch.long, device=k.device)
    c_z = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    if N * H:
        interp = interpreting()
        cfg = default_launch(K, 0, k.dtype)
        BM, BS, warps = (cfg.asg_bm, cfg.asg_bs, cfg.asg_warps) if interp or not tiles else tiles
        vq_assign_kernel[(cdiv(N, BM), H)](
            k.contiguous(), codebook.contiguous(), sq_norms.contiguous(), codes, c_z, N, S, H=H, K=K, BM=BM, BS=BS,
            BK=block(K), PREC="ieee" if interp else "tf32x3", num_warps=warps)
    return codes, c_z
