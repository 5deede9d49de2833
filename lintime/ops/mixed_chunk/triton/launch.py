"""Mixed chunk attention's launch configuration: :class:`MixedChunkLaunch` and :func:`default_launch`.

Device times below: CUDA-graph fwd+bwd ms at ``S = 128, E = 2048, C = 256``, bf16, H200, at the sequence lengths
named (2k = 2048 tokens per sequence, 32k tokens per batch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.launch_tables import LaunchConfig, pow2_at_least
from lintime.ops.kernel_launch import interpreting


@dataclass(frozen=True)
class MixedChunkLaunch(LaunchConfig):
    """Block sizes and launch settings of the kernels of :mod:`.kernels`.  Field defaults are the GPU's at
    ``S = 128, E = 2048, C = 256`` in bf16; :func:`default_launch` fits them to a shape and dtype."""

    # [C, C] chunk matrices (A, dS): row tile of every kernel; 128: 0.999 / 1.151 vs 0.925 / 1.081 ms at 2k / 32k
    # (2026-11-22)
    bg: int = 64
    # S step / tile everywhere, with the reduction's 128-row tiles: 0.684 / 0.788 (64) -> 0.650 / 0.756 ms at
    # 2k / 32k (2026-11-22)
    bs: int = 128
    bk: int = 64  # output / dV GEMMs' reduction step; 128: 1.28 / 1.38 vs 0.89 / 0.99 ms at 2k / 32k (2026-11-22)
    be_fwd: int = 128  # output GEMM's E tile; 128 / 256-row GEMM tiles: 0.945-1.167 vs 0.927 / 0.982 ms (2026-11-22)
    be_dv: int = 128  # dV GEMM's E tile (the output GEMM's kernel, transposed)
    # E step of the fused reduction over E; 32: 0.715 / 0.817 vs 0.651 / 0.753 ms at 2k / 32k (2026-11-22)
    be_red: int = 64
    # the fused reduction's [bg_red, bg_red] dS tiles and warps: [128, 128] with 8 warps 0.650 / 0.756 vs [64, 64]
    # with 4 warps 0.684 / 0.788 ms at 2k / 32k (2026-11-22)
    bg_red: int = 128
    warps_red: int = 8
    # 4 warps, 3 stages: 1.02 / 1.17 vs 8 warps, 2 stages 1.22 / 1.42 ms at 2k / 32k (2026-11-22)
    warps_fwd: int = 4
    warps_bwd: int = 4
    stages: int = 3
    bt: int = 64  # state walk's token step; 128: 1.00 / 1.10 vs 0.89 / 0.99 ms at 2k / 32k (2026-11-22)
    # state walk's [bs_state, be_state] tiles; [128, 128]: 0.772 / 0.855, [128, 32]: 0.678 / 0.864 vs 0.647 / 0.750
    # ms at 2k / 32k (2026-11-22)
    bs_state: int = 128
    be_state: int = 64
    warps_walk: int = 4  # 8 warps: 0.655 / 0.746 vs 0.655 / 0.752 ms at 2k / 32k, no gain (2026-11-22)
    # chunks per segment of the state walk, 0: by shape (:func:`.plan.seg_chunks`, measured at 4k-16k, 2026-11-22)
    seg_chunks: int = 0
    # rows of the start fix-up's [fix_bs, be_state] tiles; 64: 0.6529 / 0.6620 vs 0.6499 / 0.6584 ms at 16k / 32k
    # (2026-11-26)
    fix_bs: int = 32
    # whole-tile TMA loads where the device and shape allow (:func:`.plan.tma_shapes`); pointer loads: 0.89 / 0.99
    # vs 0.74 / 0.84 ms at 2k / 32k (2026-11-22)
    tma: bool = True
    # the fused reduction's do / v / state tiles through TMA too: 0.595 / 0.620 / 0.669 -> 0.592 / 0.616 / 0.665 ms
    # at 2k / 8k / 32k (2026-11-26; measured in bf16 only)
    tma_red: bool = True


def default_launch(S: int, E: int, dtype: torch.dtype, C: int) -> MixedChunkLaunch:
    """The launch configuration for ``S``-wide keys, ``E``-wide values, ``dtype`` inputs and chunks of ``C`` tokens
    (cached: part of a call's host time).

    The interpreter gets 16-wide blocks and 2-chunk segments so small test shapes still cross several tiles in
    every dimension (every loop of the kernels runs more than once) and several segments per sequence."""
    return _default_launch(S, E, dtype, C, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(S: int, E: int, dtype: torch.dtype, C: int, interp: bool) -> MixedChunkLaunch:
    if interp:
        return MixedChunkLaunch(bg=16, bs=16, bk=16, be_fwd=16, be_dv=16, be_red=16, bg_red=16, warps_red=1,
                                warps_fwd=1, warps_bwd=1, stages=1, bt=16, bs_state=16, be_state=16, seg_chunks=2,
                                fix_bs=8)
    common = {"bg": min(64, pow2_at_least(C)), "bs_state": min(128, pow2_at_least(S))}
    if dtype == torch.bfloat16:
        return MixedChunkLaunch(bs=min(128, pow2_at_least(S)), bg_red=min(128, pow2_at_least(C)), **common)
    # fp16 / fp32: fp32 state tiles (and fp32 inputs) in the reduction -- 128-row tiles overflow the shared memory
    # (OutOfResources on an H200), so it keeps [64, 64] tiles, 4 warps, S steps of 64, pointer loads
    return MixedChunkLaunch(bs=64, bg_red=min(64, pow2_at_least(C)), warps_red=4, tma_red=False, **common)
