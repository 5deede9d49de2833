"""Mixed chunk attention on fused Triton kernels (seed §3.2, Eqs. 6-8, Codes 1 and 8).

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` key width, ``E`` value width, ``C`` chunk
size, ``N`` sequences, ``NC`` chunks (laid out per sequence), ``NSEG`` segments (runs of
consecutive chunks of one sequence walked by one program), ``SDT`` the dtype of the per-chunk
states (:func:`lintime.ops.kernel_launch.dot_config`: bf16 for bf16 inputs, fp32 otherwise).

Kernel sequence (:mod:`lintime.ops.mixed_chunk.triton.kernels`), causal forward::

    chunk_state_kernel  the state entering every chunk, H [NC, H, S, E] (SDT), and the final kv:
                        one walk per sequence when that fills the GPU; otherwise a walk from zero
                        per segment gives segment-local states and segment totals, and
    seg_fix_kernel      adds each segment's start (initial state + earlier totals) to its states;
                        the walk's launch also runs A's programs (``Blocks.fuse_scores``; else
    mc_scores_kernel)   A [NC, H, C, C] = relu(scale q_quad k_quad^T + b)^2, causal-masked
    mc_gemm_kernel      o = wq q_lin H_c + A_c v

Non-causal (Eq. 7): every chunk reads its sequence's total.  Backward: the reverse walk on
``(q_lin, do)`` with weights ``wq`` gives ``G`` (the gradient flowing into each chunk's
``k_lin^T v``) and the initial state's gradient; then ``mc_gemm_kernel`` (``dv = wf k_lin G_c +
A^T do``), ``mc_dred_kernel`` (``dS``, stored like ``A``, and ``dq_lin, dk_lin``: both reductions over
``E`` in one launch) and ``mc_dqk_kernel`` (``dq_quad, dk_quad`` and the bias gradient).

Loads: on Hopper GPUs (``Blocks.tma``, :func:`_tma_shapes`) the output / dV GEMMs and the walks load whole
tiles through TMA tensor descriptors (inputs seen as ``[B T, H D]`` matrices, a head's tile a column offset);
elsewhere the same kernels use masked pointer loads.

What is materialised: ``A`` and ``dS`` (input dtype, ``T * C`` elements each), ``H`` and ``G``
(``T * S * E / C`` elements each, half of ``v`` at ``S = 128, C = 256``), so each large product
runs once, as a GEMM-shaped tile loop; the forward saves ``A`` and ``H`` for the backward.  The
measured alternatives are in ``docs/notes/kernels_flash.md``.

A state with a partial chunk (``fill > 0``) is a composition: its buffered tokens are prepended
to their sequence (dummy queries, outputs dropped), exactly as the chunked PyTorch form does, so
every computed sequence starts on a chunk boundary.  The final state's partial-chunk buffers are
gathered from the inputs with differentiable PyTorch indexing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from lintime.ops.gau.triton.plan import (
    Blocks,
    blocks_of,
    default_blocks,
    fold_bias_grad,
    kernel_bias,
    sequence_bounds,
    to_device,
)
from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers
from lintime.ops.mixed_chunk.triton.kernels import (
    chunk_state_kernel,
    mc_dqk_kernel,
    mc_dred_kernel,
    mc_gemm_kernel,
    mc_scores_kernel,
    seg_fix_kernel,
)
from lintime.ops.custom_op import custom_op
from lintime.ops.kernel_launch import cdiv, check_device, dot_config, next_pow2, sm_count
from lintime.ops.state_passing import seg_scan_kernel
from lintime.ops.tma import tma_descriptors, tma_device
from lintime.ops.utils import packed_cache

# Candidate launches of the mixed chunk kernels: ``(name, overrides)``, the overrides applied to the
# GPU defaults of the shape (:func:`lintime.ops.gau.triton.plan.variant_blocks`; defaults at
# ``S = 128, E = 2048, C = 256``, bf16: BG = 64, 4 warps, 3 stages, S step 128, BE = 128 output / dV,
# BK = 64, the fused reduction over E on [128, 128] tiles with 8 warps and E steps of 64, state walk
# [128, 64] tiles with 64-token steps, automatic segments).  Timed side by side by ``lintime bench ops
# --cases flash.variants`` and run against the naive form by the CUDA test ``test_launch_variants`` (the
# tile-changing ones also under the interpreter) -- a variant becomes a default only after both, on the GPU.
# H200, 2026-11-22, CUDA-graph fwd+bwd at T = 2k / 32k (docs/notes/kernels_flash.md): the v2 default (8 warps, 2 stages)
# 1.22 / 1.42 ms, "w4_s3" 1.02 / 1.17 (default since), "bg64_w4" 1.00 / 1.19, "one_seg" 1.22 / 2.25,
# "g1" 1.71 / 2.08; a later run (07:20 UTC): "w4_s3" 0.999 / 1.151, with BG = 64 ("bg64") 0.925 / 1.081
# (default since), "one_seg" 1.00 / 1.73.
LAUNCH_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("default", {}),
    # pointer loads everywhere (the path of pre-Hopper GPUs and unaligned shapes): 0.89 / 0.99 ms fwd+bwd at
    # 2k / 32k against TMA's 0.74 / 0.84 (H200, 2026-11-22 session 7)
    ("no_tma", {"tma": 0}),
    # the fused reduction kernel (mc_dred_kernel) on [64, 64] dS tiles with 4 warps and 64-wide S steps / tiles
    # everywhere (the default before session 8's promotion; H200, device fwd+bwd at 2k / 32k: 0.684 / 0.788 ms
    # against 0.650 / 0.756); [128, 128] tiles with 8 warps and S steps of 64: 0.668 / 0.771; 64-row tiles with 8
    # warps: 0.695 / 0.791
    ("red64", {"bg_red": 64, "warps_red": 4, "bs": 64}),
    ("red128_bs64", {"bs": 64}),
    # E steps of 32 in the reduction: half the shared memory per pipeline stage, so two programs of 8 warps fit an
    # SM (with [128, 128] tiles and E steps of 64 the dq_lin, dk_lin programs' 3 stages take ~192 KB) -- slower
    # (session 8, 2k / 32k: 0.715 / 0.817 and with S steps of 64 0.763 / 0.862 vs the default's 0.651 / 0.753 ms)
    ("ered32", {"be_red": 32}),
    ("ered32_bs64", {"be_red": 32, "bs": 64}),
    # Measured and removed (session 8, H200, fwd+bwd device at 2k / 32k): dS and dq_lin, dk_lin as two kernels
    # whose grids had the key tile slowest (0.742 / 0.838 vs the fused kernel's 0.686 / 0.786 ms); the state
    # walk as one loop over a segment's token steps (walks 0.162 -> 0.192 ms); segmented walks fixing their own
    # states up by look-back on flags instead of the seg_fix pass (0.684 / 0.846 vs 0.684 / 0.788 ms)
    # 4 pipeline stages in the TMA walk (standalone walk: 0.082 -> 0.077 ms; in the op no gain: 0.737 / 0.838 vs
    # 0.734 / 0.838 ms at 2k / 32k, H200 session 7)
    ("walk_s4", {"stages_walk": 4}),
    # 2 stages in the walk (48 KB of shared memory: four walk programs per SM instead of three): slower (session 9,
    # H200, device fwd+bwd at 2k / 8k / 32k: 0.666 / 0.711 / 0.744 vs 0.631 / 0.678 / 0.707 ms)
    ("walk_s2", {"stages_walk": 2}),
    # 8 warps in the state walk ([128, 64] fp32 state: 32 registers a thread), with 4 stages: no gain (session 8,
    # 2k / 32k: 0.655 / 0.746 and 0.655 / 0.757 vs the default's 0.655 / 0.752 ms)
    ("walk_w8", {"warps_walk": 8}),
    ("walk_w8_s4", {"warps_walk": 8, "stages_walk": 4}),
    # the variants below, re-timed with TMA (session 7, default 0.74 / 0.84): "w8_s2" 0.84 / 0.94, "bg128" 0.79 /
    # 0.89, "bt128" 0.78 / 0.89
    ("w8_s2", {"warps_fwd": 8, "warps_bwd": 8, "stages": 2}),  # the default before 2026-11-22
    ("bg128", {"bg": 128}),  # [128, 128] chunk-matrix tiles (the default before 2026-11-22, 07:30 UTC)
    ("s2", {"stages": 2}),  # (with BG = 128: 1.08 / 1.28 ms, run of 07:20 UTC)
    # E step 128 in the reduction, 2 stages (3: over the shared memory), with the tiles of before session 8 (0.876 /
    # 0.976 vs 0.684 / 0.788 ms then; with [128, 128] tiles it overflows the shared memory)
    ("ered128", {"be_red": 128, "stages": 2, "bg_red": 64, "warps_red": 4, "bs": 64}),
    ("be_state32", {"be_state": 32}),  # [128, 32] state-walk tiles: twice the walk programs
    # [128, 128] state-walk tiles: half the walk programs, each k_lin / q_lin step tile feeding twice the columns --
    # slower (session 8, 2k / 32k: 0.772 / 0.855, with 8 warps 0.749 / 0.832, [128, 32] tiles 0.678 / 0.864, against
    # the default's 0.647 / 0.750 ms)
    ("be_state128", {"be_state": 128}),
    ("be_state128_w8", {"be_state": 128, "warps_walk": 8}),
    ("bg64_be256_w8", {"bg": 64, "be_fwd": 256, "be_dv": 256, "warps_fwd": 8, "warps_bwd": 8}),
    ("g1", {"seg_chunks": 1}),  # one chunk per segment: a walk per chunk + the start fix-up over all chunks
    # the fused reduction's do / v / state tiles by pointers (the default before session 14; H200, interleaved graph
    # rounds, fwd+bwd at 2k / 8k / 32k: 0.595 / 0.620 / 0.669 ms against TMA's 0.592 / 0.616 / 0.665, and in a second
    # call 0.605 / 0.630 / 0.674 against 0.596 / 0.623 / 0.665).  Measured and removed in session 14 (code: 57f7fc7):
    # Triton's automatic warp specialisation of the TMA reduction's loops (0.591 / 0.616 / 0.664: no gain over TMA
    # alone); the output / dV GEMMs as persistent kernels of 2 / 3 / 4 programs per SM, every tile running all C / BK
    # key steps (zero boxes outside its causal range) so the tile loop could be flattened -- 17-32 % slower
    # (0.746-0.866 ms): one program per tile with three resident per SM overlaps better than Triton's flattened loop.
    ("red_pointers", {"tma_red": 0}),
    # the start fix-up on [64, 64] tiles (the default before session 15; H200, interleaved graph rounds, fwd+bwd at
    # 16k / 32k: 0.6529 / 0.6620 and 0.6523 / 0.6603 ms in two calls, against [32, 64]'s 0.6499 / 0.6584 and 0.6499 /
    # 0.6586).  Measured and removed in session 15: the fix-up taking 2 / 4 / 8 chunks per [n, rows, 64] load (code:
    # 6ffa391; more bytes in flight per program) -- its kernel time 0.067-0.070 ms (both passes) became 0.070-0.081,
    # fwd+bwd -0.5 to +1.9 %: the pass already runs at ~3.4 TB/s; programmatic dependent launch of every kernel (code:
    # 7b76611; each one's programs start during the tail of the one before and wait for it on the device): no gain at
    # 2k / 8k (0.600 / 0.622 vs 0.596 / 0.624 ms), 2.3 % slower at 16k / 32k (0.668 / 0.678 vs 0.653 / 0.661) --
    # likely the early resident dV GEMM programs taking the SMs the prioritised reductions were to get first.
    ("fix_bs64", {"fix_bs": 64}),
    ("one_seg", {"seg_chunks": 1 << 20}),  # one segment per sequence: no start fix-up
    # Measured on an H200 and removed (code in commit ada80ee, docs/notes/kernels_flash.md session 5): the
    # causal state walk fused with the output / dV GEMM (state in registers across a segment's chunks; 1.14 /
    # 1.31 ms fwd+bwd at 2k / 32k vs 0.93 / 1.08, every tiling and segment length slower), the two-walk state
    # pass of long sequences (totals walk + scan + second walk; 1.08 vs 0.99 ms at 32k against the segment-local
    # walk + start fix-up that replaced it) and 128 / 256-row output / dV GEMM tiles (0.945-1.167 vs 0.927 /
    # 0.982 ms).
    # Measured and removed (session 9, H200, fwd+bwd device at 2k / 32k): dq_quad, dk_quad and the bias gradient done
    # by the last dS program of each chunk in the fused reduction (a per-chunk counter; 0.665 / 0.742 against their
    # own launch's 0.639 / 0.713 ms), or as extra programs after the dV GEMM's in its launch (0.663 / 0.741 vs 0.635 /
    # 0.715): both slower -- the dq/dk work runs as the launch's tail (code in git history, fa9a2b5 / 88d9c0c)
    # A's tiles in their own launch (mc_scores_kernel; the default before session 9) instead of as extra programs
    # of the forward's state walk
    ("split_scores", {"fuse_scores": 0}),
    # Measured and removed (session 9, same run): the start fix-up moving 4 or 8 chunks per step as one [CB, 64, 64]
    # block (0.631 / 0.678 / 0.707 and 0.635 / 0.685 / 0.713 against one chunk per step's 0.634 / 0.681 / 0.700 ms at
    # 2k / 8k / 32k): the pass is bound by its traffic (~3.1 TB/s), not by its load-add-store chain (code: 2aa0d6d)
    ("seg4", {"seg_chunks": 4}),  # 4-chunk segments: 0.97 / 1.05 ms (H200 08:37 UTC)
    # 8- / 16-chunk segments: the automatic rule's choice between one segment per sequence and segments, timed
    # at the lengths in between (LINTIME_VARIANT_TS=4096,8192,16384)
    ("seg8", {"seg_chunks": 8}),
    ("seg16", {"seg_chunks": 16}),
    # (all of S in one step / tile, "bs128", was no gain with two reduction kernels -- H200 09:13 UTC: 0.930 / 0.986
    # vs 0.923 / 0.979 ms -- and is part of the default since session 8's fused reduction; "red128_bs64" above)
    # Measured on an H200 and removed (2026-11-22 session 6, code in commit d65bb21, fwd+bwd device at 2k / 32k
    # against the default's 0.89 / 0.99 ms): states stored times their consumers' weight ("fold1": 0.89 / 0.99,
    # no gain), with it the output / dV GEMM as one reduction loop whose operands are picked by pointer per
    # step ("fold2": 1.28 / 1.39), the state walk's loops flattened (tl.range(flatten=True): 0.89 / 0.99)
    # 128-wide reduction steps in the output / dV GEMMs (one S step, <= 2 key steps per row tile) and 128-token
    # walk steps: all slower (H200, session 6, fwd+bwd device at 2k / 32k: default 0.89 / 0.99 ms, bk128 1.28 / 1.38,
    # bk128_s2 1.03 / 1.13, bt128 1.00 / 1.10)
    ("bk128", {"bk": 128}),
    ("bk128_s2", {"bk": 128, "stages": 2}),
    ("bt128", {"bt": 128}),  # 128-token steps in the state walk
    # Session 11 (H200, 2026-11-26, device fwd+bwd at 2k / 8k / 16k / 32k against the default's 0.631 / 0.686 / 0.697 /
    # 0.707 ms; docs/notes/kernels_flash.md): thinner state-walk tiles -- more walk programs, so one segment per
    # sequence (no start fix-up) at 8k -- 0.663 / 0.670 / 0.761 / 0.757 ([64, 64]) and 0.799 / 0.833 / 0.816 / 0.917
    # ([32, 64]); only 8k gains (2 %, twice), not made a rule
    ("bs_state64", {"bs_state": 64}),
    ("bs_state32", {"bs_state": 32}),
    # Session 12 (H200, 2026-11-26, device fwd+bwd at 2k / 4k / 8k / 16k / 32k; docs/notes/kernels_flash.md): a
    # segment's full chunks walked as one loop over their token steps ("walk_flat"), so the loads of the next chunk are
    # in flight while a chunk's state is added and stored; a chunk's end applied without a branch, the forward's steps
    # straight into the state.  The default since: 0.613 / 0.605 / 0.666 / 0.677 / 0.686 ms; one loop per chunk (the
    # default before, "walk_loop"): 0.630 / 0.624 / 0.688 / 0.698 / 0.705.  Measured and removed: the chunk's end in a
    # branch, 0.668 / - / 0.723 / 0.735 / 0.745 (the branch around the accumulator keeps the MMA out of the pipeline,
    # as session 8 found); the forward accumulating per chunk as the reverse walk does, 0.615-0.618 / 0.610 / 0.666 /
    # 0.678 / 0.684-0.687 (no gain).  On the flat walk (same runs): 4 stages 0.636-0.650 at 2k, 0.706-0.709 at 32k, 2
    # stages 0.658 / 0.736, 8 warps 0.613-0.618 / 0.683-0.693, 128-token steps 0.637 / 0.707, [128, 32] tiles
    # 0.651-0.659 / 0.770-0.789 -- no gain.
    ("walk_loop", {"walk_flat": 0}),
    # Session 13 (H200, 2026-11-26, interleaved rounds, fwd+bwd at 2k / 4k / 8k / 16k / 32k): the backward's dV GEMM beside
    # the fused reduction and dq, dk on two streams ("bwd_streams"), so dq, dk's short launch and the kernels' tails
    # overlap the GEMM.  Device time (CUDA graphs), one stream 0.611-0.612 / 0.602-0.603 / 0.635 / 0.675-0.676 /
    # 0.683-0.686 ms; the GEMM on a second stream issued after the reductions ("streams_dv"): 0.598 / 0.590 /
    # 0.622-0.623 / 0.660-0.661 / 0.669-0.670; issued before them: 0.615 / 0.606 / 0.639 / 0.681 / 0.687 (no gain); the
    # reductions on a higher-priority second stream, the GEMM issued first (the default since): 0.596 / 0.588 / 0.620 /
    # 0.660 / 0.670, or issued last, 0.596 / 0.588 / 0.621 / 0.660 / 0.669 (the default keeps the long GEMM first in
    # issue order).  Eager A/Bs could not decide (the same code read up to 12 % apart), so eager calls keep one stream
    # (_bwd_impl).  Measured and removed: dS and dq, dk on the second stream beside the
    # reverse walk, the fused reduction split in two launches (its dS and dq_lin, dk_lin programs apart): 0.642 / 0.637
    # / 0.671 / 0.707 / 0.717, 5 % slower -- do / v are read from memory twice again (session 8); with the dV GEMM on
    # the second stream too, the same (0.644 / 0.639 / 0.672 / 0.706 / 0.715; code in b160a4d).  The final form (two
    # streams only under graph capture, 80e401e): 0.594 / 0.588 / 0.621 / 0.659 / 0.668 against one stream's 0.611 /
    # 0.602 / 0.634 / 0.673 / 0.681 in the same rounds.
    ("one_stream", {"bwd_streams": 0}),
    ("streams_dv", {"bwd_streams": 1}),
    # Measured and removed (session 12, interleaved rounds, benchmarks/ab_mixed_chunk_rounds.py): the output / dV GEMM's
    # two parts in one pipelined loop, a step of each per iteration and out-of-bounds TMA boxes (zeros) where a part
    # has run out -- 0.795 / 0.786 / 0.819 / 0.865 ms at 2k / 4k / 8k / 32k against 0.612 / 0.604 / 0.636 / 0.684 (twice
    # the pipeline buffers: one program per SM instead of three; with 64-wide E tiles 0.779-0.848; code in git history,
    # d10f9b5).  Each row tile's diagonal dS tile computed by its first dq_lin, dk_lin program from the do / v tiles
    # it loads anyway (a third accumulator: the fused reduction 0.169 -> 0.190 ms, fwd+bwd 0.618 -> 0.638 at 2k; code
    # in git history, 778d60f)
)


def _sdt_torch(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk states: :func:`dot_config`'s ``SDT`` as a torch dtype."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _n_seqs(B: int, cu_seqlens) -> int:
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _chunk_bound(B: int, T: int, C: int, cu_seqlens) -> int:
    """Chunks of the call, or an upper bound from shapes alone (custom-op outputs must be sized
    without reading ``cu_seqlens``): ``sum_n ceil(L_n / C) <= N + T // C``."""
    if cu_seqlens is None:
        return B * math.ceil(T / C)
    return _n_seqs(B, cu_seqlens) + T // C


def _seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg: Blocks, device) -> int:
    """Chunks per segment of the state walk, from shapes only.  One segment per sequence when
    sequences x state tiles already give every SM a program; otherwise segments for about two walk
    programs per SM (all resident at once), never fewer than 2 chunks per segment.

    H200, 2026-11-22 (session 9), fwd+bwd device ms at S = 128, E = 2048, C = 256, 32k tokens (32 state
    tiles): 4k (8 sequences: 256 programs unsegmented) one segment 0.640 against 8-chunk segments 0.708;
    8k 16-chunk segments (256 programs) 0.702, one segment 0.710, 8-chunk 0.725; 16k 16-chunk 0.716,
    8-chunk 0.744, one segment 0.895 (the rule before aimed at four programs per SM: 8-chunk segments)."""
    nct = max(1, _chunk_bound(B, T, C, cu_seqlens))
    if cfg.seg_chunks > 0:
        return min(cfg.seg_chunks, nct)
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    sms = sm_count(device)
    if _n_seqs(B, cu_seqlens) * tiles >= sms:
        return nct
    want = max(1, 2 * sms // tiles)  # segments in all
    return min(nct, max(2, math.ceil(nct / want)))


def _walk_cfg(B, T, H, S, E, C, cu_seqlens, cfg: Blocks, device) -> Blocks:
    """``cfg`` with the state walk's ``S`` tile halved (once, from more than 64) where that alone gives every SM a
    walk program with one segment per sequence -- sequences x tiles short of the SM count at ``bs_state``, enough
    at half of it -- so no segment-start fix-up runs; automatic segments only (``seg_chunks = 0``).  From shapes
    only: the forward and the backward agree.

    H200, 2026-11-26 (session 12), fwd+bwd device ms at S = 128, E = 2048, C = 256, 32k tokens, the flat walk: 8k
    (4 sequences x 32 tiles of [128, 64] = 128 programs, 132 SMs) 16-chunk segments 0.665-0.666, one segment on
    [128, 64] tiles 0.650-0.659, on [64, 64] tiles 0.638-0.643; at 4k (256 programs of [128, 64]) the thinner
    tiles are slower (0.650 vs 0.609), at 16k (128 programs of [64, 64]) too (0.720 vs 0.677, segments)."""
    if cfg.seg_chunks or cfg.bs_state <= 64:
        return cfg
    return _thin_walk(_n_seqs(B, cu_seqlens), H, S, E, cfg, str(device))


@functools.lru_cache(maxsize=64)
def _thin_walk(n, H, S, E, cfg: Blocks, device: str) -> Blocks:
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    thin = H * cdiv(S, cfg.bs_state // 2) * cdiv(E, cfg.be_state)
    if n * tiles < sm_count(torch.device(device)) <= n * thin:
        return dataclasses.replace(cfg, bs_state=cfg.bs_state // 2)
    return cfg


def _seg_bound(B, T, C, cu_seqlens, G) -> int:
    """Segments, or a bound from shapes: ``sum_n ceil(nc_n / G) <= N + NC // G``."""
    if cu_seqlens is None:
        return B * math.ceil(math.ceil(T / C) / G)
    return _n_seqs(B, cu_seqlens) + _chunk_bound(B, T, C, cu_seqlens) // G


def _tma_shapes(cfg: Blocks, S: int, E: int, C: int, device: torch.device) -> bool:
    """Whether the kernels load through TMA descriptors at this shape (``Blocks.tma``, a TMA device,
    and every tile whole inside its head / chunk: ``S``, ``E``, ``C`` multiples of the tiles along
    them).  A function of the call's shape only, so the forward and the backward agree on it (the
    forward zero-fills ``A`` for the backward's TMA path when a chunk is short)."""
    return bool(
        cfg.tma and tma_device(device)
        and S % cfg.bk == 0 and S % cfg.bs_state == 0
        and E % cfg.be_fwd == 0 and E % cfg.be_dv == 0 and E % cfg.be_state == 0
        and C % cfg.bg == 0 and C % cfg.bk == 0
    )


@dataclass
class _Plan:
    """Launch tables of one call (device int32) and their sizes."""

    N: int
    NC: int
    NSEG: int
    NC_alloc: int
    NSEG_alloc: int
    one_segment: bool  # every sequence is one segment
    ragged: bool  # some chunk is shorter than C
    ch_start: torch.Tensor
    ch_len: torch.Tensor
    ch_seq: torch.Tensor
    ch_k: torch.Tensor
    ch_id: torch.Tensor
    seg_first: torch.Tensor
    seg_n: torch.Tensor
    seg_seq: torch.Tensor
    seq_ptr: torch.Tensor
    lengths: torch.Tensor  # [N] on the device
    weights: dict  # (C, causal, linear_norm) -> (wq, wf) of calls without a state


def _plan(B, T, H, S, E, C, cu_seqlens, cfg, device) -> _Plan:
    """The call's tables; unpacked calls reuse those of the same shape (no host work, no copy), packed calls those of
    the same ``cu_seqlens`` tensor (:func:`lintime.ops.utils.packed_cache`: a model's layers and backward
    passes skip the host read of ``cu_seqlens`` and the rebuild)."""
    if cu_seqlens is None:
        return _regular_plan(B, T, H, S, E, C, cfg, str(device))
    entry = packed_cache(cu_seqlens, ("mixed_chunk", B, T, H, S, E, C, cfg, str(device)))
    if "plan" not in entry:
        entry["plan"] = _build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device)
    return entry["plan"]


@functools.lru_cache(maxsize=64)
def _regular_plan(B, T, H, S, E, C, cfg, device) -> _Plan:
    return _build_plan(B, T, H, S, E, C, None, cfg, torch.device(device))


def _build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device) -> _Plan:
    G = _seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg, device)
    starts, lengths = sequence_bounds(B, T, cu_seqlens)
    N = lengths.numel()
    nch = (lengths + C - 1) // C  # [N]
    seq = torch.arange(N)
    ch_seq = torch.repeat_interleave(seq, nch)
    first_ch = torch.cumsum(nch, 0) - nch
    ch_k = torch.arange(ch_seq.numel()) - first_ch[ch_seq]
    ch_start = starts[ch_seq] + ch_k * C
    ch_len = torch.clamp(lengths[ch_seq] - ch_k * C, max=C)
    nseg = (nch + G - 1) // G
    seq_ptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(nseg, 0)])
    seg_seq = torch.repeat_interleave(seq, nseg)
    seg_k = torch.arange(seg_seq.numel()) - seq_ptr[seg_seq]
    seg_first = first_ch[seg_seq] + seg_k * G
    seg_n = torch.clamp(nch[seg_seq] - seg_k * G, max=G)
    t = to_device(device, ch_start, ch_len, ch_seq, ch_k, torch.arange(ch_seq.numel()), seg_first, seg_n, seg_seq,
                  seq_ptr, lengths)
    one = bool((nseg <= 1).all())
    ragged = bool((ch_len < C).any())
    return _Plan(N, ch_seq.numel(), seg_seq.numel(), _chunk_bound(B, T, C, cu_seqlens),
                 _seg_bound(B, T, C, cu_seqlens, G), one, ragged, *t, weights={})


def _weights(plan: _Plan, C, causal, linear_norm, count0):
    """Per chunk: ``wq`` (the linear part's ``1 / N``) and ``wf`` (whether the chunk's sum enters
    the states: a short last chunk of a causal call feeds no later token).  Kept with the plan
    for calls without a state."""
    if count0 is None:
        key = (C, causal, linear_norm)
        if key not in plan.weights:
            plan.weights[key] = _compute_weights(plan, C, causal, linear_norm, None)
        return plan.weights[key]
    return _compute_weights(plan, C, causal, linear_norm, count0)


def _compute_weights(plan: _Plan, C, causal, linear_norm, count0):
    seq, k, ln = plan.ch_seq.long(), plan.ch_k.long(), plan.ch_len
    if causal:
        wf = (ln == C).to(torch.float32)
    else:
        wf = torch.ones(plan.NC, dtype=torch.float32, device=ln.device)
    if linear_norm == "none":
        wq = torch.ones_like(wf)
    elif linear_norm == "chunk":
        wq = torch.full_like(wf, 1.0 / C)
    else:  # 'tokens': tokens in the sum (seed Code 8's normalised mask); an empty sum gives 0
        if causal:
            n = k * C
            if count0 is not None:
                n = n + count0.to(n.device).long()[seq]
        else:
            n = plan.lengths.long()[seq]
        wq = torch.where(n > 0, 1.0 / n.clamp(min=1).to(torch.float32), torch.zeros_like(wf))
    return wq.contiguous(), wf.contiguous()


def _walk(x, y, w, plan: _Plan, cfg, *, H, C, reverse, store, hout, tot, init=None, tma=False, scores=None):
    """``chunk_state_kernel`` over every segment: with ``init`` (one walk per sequence) each walk starts
    from its sequence's initial state, else from zero; ``tma``: load through descriptors where aligned;
    ``scores``: the :class:`_ScoresJob` whose programs the same launch runs after the walk's."""
    S, E = x.shape[-1], y.shape[-1]
    nwalk = cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state) * plan.NSEG * H
    nscores = scores.programs if scores is not None else 0
    if nwalk + nscores == 0:
        return
    NT = x.shape[0] * x.shape[1]
    d = tma_descriptors((x, NT, (cfg.bt, cfg.bs_state)), (y, NT, (cfg.bt, cfg.be_state))) if tma else None
    sc = scores or _ScoresJob(x, x, x, None, 1.0, 1, 1, 1, 1, 16, False, 0)
    chunk_state_kernel[(nwalk + nscores,)](
        x, y, *(d or (x, y)), hout, tot, init if init is not None else tot, w,
        plan.seg_first, plan.seg_n, plan.seg_seq, plan.ch_start, plan.ch_len, S, E, H, plan.NSEG, C,
        sc.qq, sc.kq, sc.a, sc.bias if sc.bias is not None else x, sc.scale, sc.C, sc.LB, sc.NMT,
        BS=cfg.bs_state, BE=cfg.be_state, BT=cfg.bt, REVERSE=reverse, STORE=store, HAS_INIT=init is not None,
        PREC=dot_config(x.dtype)[1], TMA=d is not None, FLAT=bool(cfg.walk_flat) and C % cfg.bt == 0,
        SCORES=scores is not None, BG=sc.BG, BSQ=sc.BS,
        CAUSAL=sc.causal, HAS_BIAS=sc.bias is not None, num_warps=cfg.warps_walk or 4,
        num_stages=cfg.stages_walk or cfg.stages,
    )


@dataclass
class _ScoresJob:
    """The arguments of ``A``'s programs (``_scores_tile``), launched with the forward's state walk."""

    qq: torch.Tensor
    kq: torch.Tensor
    a: torch.Tensor
    bias: torch.Tensor | None
    scale: float
    C: int
    LB: int
    NMT: int
    BG: int
    BS: int
    causal: bool
    programs: int


def _scan(tot, plan: _Plan, *, H, S, E, reverse):
    """lintime.ops.state_passing's segment scan: each sequence's total over its segments (non-causal calls)."""
    final = torch.empty(plan.N, H, S, E, dtype=torch.float32, device=tot.device)
    if plan.N > 0:
        SK, SV = min(32, next_pow2(max(S, 16))), min(32, next_pow2(max(E, 16)))
        seg_scan_kernel[(cdiv(S, SK) * cdiv(E, SV), plan.N, H)](
            tot, tot, tot, tot, tot, tot, tot, final, final, plan.seq_ptr, 0,
            H=H, K=S, V=E, BK=SK, BV=SV, VARLEN=True, USE_G=False, REVERSE=reverse, NORM=False,
            HAS_INIT=False, STORE_START=False, num_warps=2,
        )
    return final


def _states(x, y, w, plan: _Plan, cfg, *, H, C, reverse, init, causal, sdt, tma, scores=None):
    """Per-chunk states of the walk direction and the per-sequence result.

    Causal: ``(ST [NC_alloc, H, S, E] in sdt, the state entering each chunk; FINAL [N, H, S, E]
    fp32)``.  Non-causal: ``(ST [N, H, S, E] in sdt, FINAL)``, each sequence's total.
    """
    S, E = x.shape[-1], y.shape[-1]
    f32 = {"dtype": torch.float32, "device": x.device}
    if not causal:
        tot = torch.empty(max(plan.NSEG, 1), H, S, E, **f32)
        _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=False, hout=tot, tot=tot,
              scores=scores)
        final = _scan(tot, plan, H=H, S=S, E=E, reverse=reverse)
        return final.to(sdt), final
    hout = torch.empty(plan.NC_alloc, H, S, E, dtype=sdt, device=x.device)
    if plan.NC_alloc > plan.NC:
        hout[plan.NC :].zero_()  # the shape bound's slack rows (packed calls)
    if plan.one_segment and plan.NSEG == plan.N:
        # one walk per (non-empty) sequence from its initial state writes the final states in place: no
        # zero fill and no copy from the totals (H200, 2026-11-22: 0.93 -> 0.89 ms fwd+bwd at 2k)
        final = torch.empty(plan.N, H, S, E, **f32)
        _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=True, hout=hout, tot=final, init=init,
              scores=scores)
        return hout, final
    tot = torch.empty(max(plan.NSEG, 1), H, S, E, **f32)
    final = init.clone() if init is not None else torch.zeros(plan.N, H, S, E, **f32)  # (empty sequences)
    if plan.one_segment:
        # one walk per sequence from the initial state; the walk's total is the final state
        _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=True, hout=hout, tot=tot, init=init,
              scores=scores)
        if plan.NSEG > 0:
            final.index_copy_(0, plan.seg_seq.long(), tot[: plan.NSEG])
        return hout, final
    # one walk from zero at every segment writes segment-local states and totals; one pass adds each
    # segment's start (init + the totals walked before it) and writes the final states
    _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=True, hout=hout, tot=tot, scores=scores)
    if plan.NSEG > 0:
        BS, BE = min(cfg.fix_bs or 64, cfg.bs_state), cfg.be_state
        seg_fix_kernel[(cdiv(S, BS) * cdiv(E, BE), plan.NSEG, H)](
            hout, tot, init if init is not None else tot, final, plan.seg_first, plan.seg_n, plan.seg_seq,
            plan.seq_ptr, S, E, H, BS=BS, BE=BE, REVERSE=reverse, HAS_INIT=init is not None, num_warps=4,
        )
    return hout, final


def _gemm(ts, w, idx, out, plan: _Plan, cfg: Blocks, *, tma, S, E, H, C, NMT, BE, trans, causal, PREC, SDT, warps):
    """The output GEMM (``ts = (a, v, q_lin, H)``) or the dV GEMM (``trans``; ``(a, do, k_lin, G)``, ``A``'s tiles
    read transposed), through TMA descriptors (``tma``, where aligned) or pointers."""
    a, y, lin, st = ts
    BG, BK = cfg.bg, cfg.bk
    NT = y.shape[0] * y.shape[1]
    d = tma_descriptors((a, a.shape[0] * H * C, (BK, BG) if trans else (BG, BK)), (y, NT, (BK, BE)),
                        (lin, NT, (BG, BK)), (st, st.shape[0] * H * S, (BK, BE))) if tma else None
    mc_gemm_kernel[(cdiv(E, BE), plan.NC * NMT, H)](
        *ts, *(d or ts), w, idx, out, plan.ch_start, plan.ch_len, S, E, H, C, NMT, BG=BG, BE=BE, BK=BK,
        TRANS=trans, CAUSAL=causal, PREC=PREC, SDT=SDT, TMA=d is not None, num_warps=warps, num_stages=cfg.stages,
    )


# --------------------------------------------------------------------------------- forward op


def _fwd_fake(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, blocks):
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    N = _n_seqs(B, cu_seqlens)
    nc = _chunk_bound(B, T, C, cu_seqlens)
    f32 = {"dtype": torch.float32, "device": qq.device}
    a = qq.new_empty(nc, H, C, C)
    st = qq.new_empty((nc if causal else N, H, S, E), dtype=_sdt_torch(qq.dtype))
    final = torch.empty(N, H, S, E, **f32) if causal else qq.new_empty(0, dtype=torch.float32)
    return torch.empty_like(v), final, a, st


def _mixed_chunk_fwd(
    qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor, kl: torch.Tensor, v: torch.Tensor,
    rel_bias: torch.Tensor | None, kv0: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, chunk_size: int, causal: bool, scale: float, linear_norm: str,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final kv, A, H)``; ``A`` and ``H`` are saved for the backward (non-causal: ``H`` holds
    each sequence's total and the final kv is empty)."""
    return _fwd_impl(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
                     blocks_of(blocks), zero_a=True)


def _fwd_impl(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
              cfg: Blocks, zero_a: bool):
    """The forward launcher (``lintime::mixed_chunk_fwd`` and the eager path).  ``zero_a``: zero the
    entries of ``A`` no kernel writes (an op output must be fully defined; the eager path, which
    never hands ``A`` out, leaves them: the kernels never read them)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    cfg = _walk_cfg(B, T, H, S, E, C, cu_seqlens, cfg, qq.device)
    plan = _plan(B, T, H, S, E, C, cu_seqlens, cfg, qq.device)
    tma = _tma_shapes(cfg, S, E, C, qq.device)
    wq, wf = _weights(plan, C, causal, linear_norm, count0)
    # unwritten entries of A (above the diagonal, past a short chunk, the shape bound's slack rows)
    # are never read by the pointer kernels, but an op's outputs must be fully defined (torch.compile
    # compares them), and the backward's TMA path reads whole tiles: rows past a short chunk must be 0
    zero_a = zero_a or (tma and plan.ragged)
    a = qq.new_zeros(plan.NC_alloc, H, C, C) if zero_a else qq.new_empty(plan.NC_alloc, H, C, C)
    o = torch.empty_like(v)
    bias, LB = kernel_bias(rel_bias)
    SDT, PREC = dot_config(qq.dtype)
    BG = cfg.bg
    NMT = cdiv(C, BG)
    # A's programs run in the state walk's launch (Blocks.fuse_scores) or in their own
    job = _ScoresJob(qq, kq, a, bias, float(scale), C, LB, NMT, BG, cfg.bs, bool(causal), plan.NC * NMT * NMT * H)
    fuse = bool(cfg.fuse_scores)
    st, final = _states(kl, v, wf, plan, cfg, H=H, C=C, reverse=False, init=kv0 if causal else None, causal=causal,
                        sdt=_sdt_torch(qq.dtype), tma=tma, scores=job if fuse else None)
    if plan.NC > 0:
        if not fuse:
            mc_scores_kernel[(plan.NC * NMT, NMT, H)](
                qq, kq, a, bias if bias is not None else qq, plan.ch_start, plan.ch_len,
                float(scale), S, H, C, LB, NMT, BG=BG, BS=cfg.bs, CAUSAL=causal, HAS_BIAS=bias is not None,
                PREC=PREC, num_warps=cfg.warps_fwd, num_stages=cfg.stages,
            )
        _gemm((a, v, ql, st), wq, plan.ch_id if causal else plan.ch_seq, o, plan, cfg, tma=tma, S=S, E=E, H=H, C=C,
              NMT=NMT, BE=cfg.be_fwd, trans=False, causal=causal, PREC=PREC, SDT=SDT, warps=cfg.warps_fwd)
    if not causal:
        final = qq.new_empty(0, dtype=torch.float32)
    return o, final, a, st


# --------------------------------------------------------------------------------- backward op


def _bwd_fake(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
              linear_norm, need_db, has_kv0, blocks):
    B, _, H, S = qq.shape
    E = v.shape[-1]
    db = rel_bias.new_empty(rel_bias.shape) if (need_db and rel_bias is not None) else qq.new_empty(0)
    N = _n_seqs(B, cu_seqlens)
    dkv0 = qq.new_empty((N, H, S, E), dtype=torch.float32) if has_kv0 else qq.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(qq), torch.empty_like(kq), torch.empty_like(ql), torch.empty_like(kl),
            torch.empty_like(v), db, dkv0)


def _mixed_chunk_bwd(
    do: torch.Tensor, dkv: torch.Tensor | None, qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor,
    kl: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, a: torch.Tensor, st: torch.Tensor, chunk_size: int, causal: bool,
    scale: float, linear_norm: str, need_db: bool, has_kv0: bool, blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the five inputs, of ``rel_bias`` (empty unless ``need_db``) and of the initial
    ``kv`` (empty unless ``has_kv0``)."""
    return _bwd_impl(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
                     linear_norm, need_db, has_kv0, blocks_of(blocks))


mixed_chunk_bwd = custom_op("mixed_chunk_bwd", _bwd_fake)(_mixed_chunk_bwd)


def _bwd_impl(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
              linear_norm, need_db, has_kv0, cfg: Blocks):
    """The backward launcher (``lintime::mixed_chunk_bwd`` and the eager path)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    dev = qq.device
    do = do.contiguous()
    cfg = _walk_cfg(B, T, H, S, E, C, cu_seqlens, cfg, dev)
    plan = _plan(B, T, H, S, E, C, cu_seqlens, cfg, dev)
    tma = _tma_shapes(cfg, S, E, C, dev)
    wq, wf = _weights(plan, C, causal, linear_norm, count0)
    init = dkv.contiguous() if (causal and dkv is not None) else None
    idx = plan.ch_id if causal else plan.ch_seq
    bias, LB = kernel_bias(rel_bias)
    need_db = need_db and bias is not None
    SDT, PREC = dot_config(qq.dtype)
    BG = cfg.bg
    NMT = cdiv(C, BG)
    dv = torch.empty_like(v)
    dql, dkl = torch.empty_like(ql), torch.empty_like(kl)
    dqq, dkq = torch.empty_like(qq), torch.empty_like(kq)
    ds = qq.new_empty(plan.NC_alloc, H, C, C)
    ntd = 2 * NMT - 1
    # (no bias gradient: a 1-element placeholder the kernel never touches, not a fill)
    db_tiles = (torch.zeros((H, ntd, BG, BG), dtype=torch.float32, device=dev) if need_db
                else torch.empty(1, dtype=torch.float32, device=dev))
    # Blocks.bwd_streams: the dV GEMM beside the fused reduction and dq, dk on two streams.  2 (the default): the GEMM
    # issued first on the calling stream, the reductions on a second stream of higher priority -- the GPU gives them
    # the SMs first and the GEMM fills around their tail and dq, dk.  1: the GEMM on a second stream, issued after the
    # reductions (the same device time).  Only while a CUDA graph is being captured (CUDA graphs, torch.compile's
    # "reduce-overhead"), where the device time is what the gain was measured in.  Eager calls, bound by the host, keep
    # one stream (mode 2's launch order is then mode 0's): their interleaved A/Bs were too noisy to decide (two
    # streams read 1-17 % slower, but one and the same code path read 12 % apart from itself, H200, session 13), and the
    # fork / join costs 8 us of host time.  Every tensor the second stream touches is allocated above on the calling
    # stream and lives until the join below, so the caching allocator needs no record_stream.  Under the interpreter
    # (CPU tensors) the same launches run in order.
    mode = cfg.bwd_streams
    two = bool(mode) and dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    side = _side_stream(dev, hi=mode == 2) if two else None
    gst, gfinal = _states(ql, do, wq, plan, cfg, H=H, C=C, reverse=True, init=init, causal=causal,
                          sdt=_sdt_torch(qq.dtype), tma=tma)
    if plan.NC > 0:
        rows = plan.NC * NMT
        NT = B * T
        BGR = cfg.bg_red or BG
        NMTR = cdiv(C, BGR)
        b_ptr = bias if bias is not None else qq

        def dv_gemm():  # dV = wf Kl G + A^T dO
            _gemm((a, do, kl, gst), wf, idx, dv, plan, cfg, tma=tma, S=S, E=E, H=H, C=C, NMT=NMT, BE=cfg.be_dv,
                  trans=True, causal=causal, PREC=PREC, SDT=SDT, warps=cfg.warps_bwd)

        def reductions():  # dS, dq_lin, dk_lin (one launch), then dq_quad, dk_quad and the bias gradient
            dr = None
            if tma and cfg.tma_red and E % cfg.be_red == 0 and S % cfg.bs == 0:
                dr = tma_descriptors((do, NT, (BGR, cfg.be_red)), (v, NT, (BGR, cfg.be_red)),
                                     (st, st.shape[0] * H * S, (cfg.bs, cfg.be_red)),
                                     (gst, gst.shape[0] * H * S, (cfg.bs, cfg.be_red)))
            mc_dred_kernel[(NMTR + cdiv(S, cfg.bs), plan.NC * NMTR, H)](
                qq, kq, v, do, ds, b_ptr, st, gst, wq, wf, idx, dql, dkl, plan.ch_start, plan.ch_len,
                *(dr or (do, v, st, gst)),
                float(scale), S, E, H, C, LB, NMTR, BG=BGR, BS=cfg.bs, BE=cfg.be_red, CAUSAL=causal,
                HAS_BIAS=bias is not None, PREC=PREC, SDT=SDT, TMA=dr is not None,
                num_warps=cfg.warps_red or cfg.warps_bwd, num_stages=cfg.stages,
            )
            mc_dqk_kernel[(cdiv(S, cfg.bs), rows, H)](
                qq, kq, ds, dqq, dkq, db_tiles, plan.ch_start, plan.ch_len,
                float(scale), S, H, C, NMT, ntd, BG=BG, BS=cfg.bs, CAUSAL=causal, NEED_DB=need_db, PREC=PREC,
                num_warps=cfg.warps_bwd, num_stages=cfg.stages,
            )

        cur = side.fork() if side is not None else None  # after the states
        if mode == 0:
            dv_gemm()
            reductions()
        elif mode == 1:
            reductions()
            with _on(side, cur):
                dv_gemm()
        else:
            dv_gemm()
            with _on(side, cur):
                reductions()
        if side is not None:
            side.join(cur)
    db = fold_bias_grad(db_tiles, LB, C - 1, BG, rel_bias.dtype) if need_db else qq.new_empty(0)
    dkv0 = gfinal if (causal and has_kv0) else qq.new_empty(0, dtype=torch.float32)
    return dqq, dkq, dql, dkl, dv, db, dkv0


class _Side:
    """A second stream of one device for the backward's independent launches (``Blocks.bwd_streams``), with two
    events reused by every call: ``fork`` makes the second stream wait for the calling one, ``join`` the reverse.
    (A wait holds the event's record as of the wait, so re-recording it later is safe, in eager calls and under
    CUDA graph capture.)  Reused events and a plain ``set_stream`` keep the host cost of a fork and a join low:
    ``benchmarks/exp_stream_host.py`` measured 8 us per backward on the H200 host, against 21-38 us with
    ``Stream.wait_stream`` (a new event each time) and the ``torch.cuda.stream`` context manager."""

    def __init__(self, device: int, hi: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1 if hi else 0)
        self.ev_fork = torch.cuda.Event()
        self.ev_join = torch.cuda.Event()

    def fork(self) -> torch.cuda.Stream:
        """Make the second stream wait for the calling stream's work so far; returns the calling stream."""
        cur = torch.cuda.current_stream(self.device)
        self.ev_fork.record(cur)
        self.stream.wait_event(self.ev_fork)
        return cur

    @contextlib.contextmanager
    def on(self, cur: torch.cuda.Stream):
        """Launches on the second stream; back to ``cur`` after."""
        torch.cuda.set_stream(self.stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(cur)

    def join(self, cur: torch.cuda.Stream):
        """Make ``cur`` wait for the second stream's work so far."""
        self.ev_join.record(self.stream)
        cur.wait_event(self.ev_join)


def _side_stream(dev: torch.device, hi: bool = False) -> _Side:
    """The :class:`_Side` of ``dev`` (``hi``: a stream whose blocks the GPU schedules before those of
    default-priority streams), made once per device and priority."""
    return _side_of(dev.index if dev.index is not None else torch.cuda.current_device(), hi)


@functools.cache
def _side_of(index: int, hi: bool) -> _Side:
    return _Side(index, hi)


def _on(side: _Side | None, cur):
    """Launches on ``side``'s stream (forked from ``cur`` by the caller), or on the calling stream."""
    return side.on(cur) if side is not None else contextlib.nullcontext()


def _setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[2], output[3])
    _save(ctx, inputs, output)


def _save(ctx, inputs, output):
    qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, blocks = inputs
    _, _, a, st = output
    ctx.save_for_backward(qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st)
    ctx.args = (chunk_size, causal, scale, linear_norm)
    ctx.blocks = blocks
    ctx.has_kv0 = kv0 is not None


def _backward(ctx, do, dkv, _da, _dst, eager=False):
    """Backward of ``lintime::mixed_chunk_fwd`` (through ``lintime::mixed_chunk_bwd``, which
    ``torch.compile`` and opcheck trace) and of the eager Function (``eager``: the launcher itself)."""
    qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st = ctx.saved_tensors
    need_db = rel_bias is not None and ctx.needs_input_grad[5]
    has_kv0 = ctx.has_kv0 and ctx.needs_input_grad[6]
    if dkv is not None and dkv.numel() == 0:
        dkv = None
    if not eager:
        dqq, dkq, dql, dkl, dv, db, dkv0 = mixed_chunk_bwd(
            do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, *ctx.args, need_db, has_kv0,
            ctx.blocks,
        )
    else:  # skip the op dispatch
        if do is None:  # only the final state is used (the Function does not materialise zero grads)
            do = torch.zeros_like(v)
        dqq, dkq, dql, dkl, dv, db, dkv0 = _bwd_impl(
            do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, *ctx.args, need_db, has_kv0,
            blocks_of(ctx.blocks),
        )
    return (dqq, dkq, dql, dkl, dv, db if need_db else None, dkv0 if has_kv0 else None,
            None, None, None, None, None, None, None)


mixed_chunk_fwd = custom_op("mixed_chunk_fwd", _fwd_fake, backward=_backward, setup_context=_setup)(_mixed_chunk_fwd)


class _EagerMixedChunk(torch.autograd.Function):
    """The same forward / backward as ``lintime::mixed_chunk_fwd`` for eager calls, without the
    custom-op dispatch, without zero gradients for the outputs a caller does not use (the op's
    autograd materialises ``A``, ``H`` and the final kv as zeros: tens of MB of fills per backward)
    and without zero-filling ``A``'s unread entries.  ``torch.compile`` traces the custom op
    instead (:func:`triton_mixed_chunk_attention` picks).  Returns ``o, final kv``."""

    @staticmethod
    def forward(ctx, qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
                blocks):
        ctx.set_materialize_grads(False)
        inputs = (qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
                  blocks)
        out = _fwd_impl(*inputs[:13], blocks_of(blocks), zero_a=False)
        _save(ctx, inputs, out)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, do, dkv):
        return _backward(ctx, do, dkv, None, None, eager=True)


def _forward(*args, blocks: Blocks, grad: bool):
    """``(o, final kv)`` of the call: the custom op under ``torch.compile``, else the eager Function
    (``grad``) or the bare launcher."""
    if torch.compiler.is_compiling():
        return mixed_chunk_fwd(*args, blocks.to_list())[:2]
    if grad:
        return _EagerMixedChunk.apply(*args, blocks)
    return _fwd_impl(*args, blocks, zero_a=False)[:2]


# --------------------------------------------------------------------------------- entry


def _final_buffers(xs, starts, lengths, C):
    """The partial last chunk of each sequence (``fill = L % C`` tokens, zero past ``fill``) of the
    flat inputs ``xs`` (``k_quad, k_lin, v`` as ``[TT, H, D]``): differentiable gathers."""
    dev = xs[0].device
    fill = lengths % C
    first = starts + lengths - fill  # [N]
    slot = torch.arange(C, device=dev)
    idx = (first[:, None] + slot[None, :]).clamp(max=max(xs[0].shape[0] - 1, 0))  # [N, C]
    keep = (slot[None, :] < fill[:, None])[:, :, None, None]
    out = []
    for x in xs:
        g = x.index_select(0, idx.reshape(-1)).view(idx.shape[0], C, *x.shape[1:])
        out.append(torch.where(keep, g, torch.zeros((), dtype=x.dtype, device=dev)))
    return out, fill


def triton_mixed_chunk_attention(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size=256, causal=True, rel_bias=None, scale=None,
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None, blocks: Blocks | None = None,
):
    """Fused mixed chunk attention: same arguments and results as
    :func:`lintime.ops.mixed_chunk.naive.naive_mixed_chunk_attention` (``q_*, k_*`` ``[B, T, H, S]``,
    ``v`` ``[B, T, H, E]``, ``rel_bias`` ``[H, 2C - 1]``); fp16 / bf16 / fp32 inputs, fp32
    accumulation, ``S <= 512`` and ``E <= 4096`` tiled.  ``blocks`` overrides the block sizes
    (:func:`lintime.ops.gau.triton.plan.default_blocks`).  fp64 inputs and empty calls go to the
    chunked PyTorch form."""
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    C = chunk_size
    if q_quad.dtype == torch.float64 or B * T == 0:
        from lintime.ops.mixed_chunk.chunk import chunk_mixed_chunk_attention

        return chunk_mixed_chunk_attention(
            q_quad, k_quad, q_lin, k_lin, v, chunk_size=C, causal=causal, rel_bias=rel_bias, scale=scale,
            linear_norm=linear_norm, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )
    check_device("mixed_chunk_attention", q_quad)
    scale = 1.0 / C if scale is None else float(scale)
    blocks = blocks or default_blocks(S, E, q_quad.dtype, C)
    xs = [q_quad, k_quad, q_lin, k_lin, v]
    kv0 = count0 = keep = None
    if initial_state is not None:
        kv0 = initial_state.kv.to(torch.float32)
        count0 = initial_state.count
        fills = initial_state.fill.tolist()
        if any(fills):
            from lintime.ops.mixed_chunk.chunk import _prepend_buffers
            from lintime.ops.utils import seq_bounds

            bufs = clean_buffers(initial_state, q_quad.dtype)
            xs, cu_seqlens, keep = _prepend_buffers(xs, bufs, fills, seq_bounds(B, T, cu_seqlens))
    xs = [x.contiguous() for x in xs]
    Bx, Tx = xs[0].shape[:2]
    grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (*xs, rel_bias, kv0)
    )
    o, final_kv = _forward(*xs, rel_bias, kv0, count0, cu_seqlens, C, bool(causal), scale, linear_norm,
                           blocks=blocks, grad=grad)
    if keep is not None:
        o = o.reshape(Bx * Tx, H, E).index_select(0, keep).view(B, T, H, E)
    if not output_final_state:
        return o, None
    starts, lengths = (x.to(q_quad.device) for x in sequence_bounds(Bx, Tx, cu_seqlens))
    flat = [x.view(Bx * Tx, H, x.shape[-1]) for x in (xs[1], xs[3], xs[4])]
    (bk, bl, bv), fill = _final_buffers(flat, starts, lengths, C)
    done = lengths - fill
    state = MixedChunkState(
        kv=final_kv.to(initial_state.kv.dtype) if initial_state is not None else final_kv,
        count=done if count0 is None else count0 + done,
        k_quad=bk, k_lin=bl, v=bv, fill=fill,
    )
    return o, state
