"""Mixed chunk attention's launch configuration: :class:`MixedChunkLaunch` and :func:`default_launch`, for the training
kernels and the decoding step alike, and the config's two shape rules of a call (:meth:`MixedChunkLaunch.thin_walk`,
:meth:`MixedChunkLaunch.decode_tiles`).

What chose the defaults: ``docs/design/kernels.md`` (mixed chunk attention).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, block, cdiv, interpreting, sm_count


@dataclass(frozen=True)
class MixedChunkLaunch(LaunchConfig):
    """Block sizes and launch settings of the training kernels (:mod:`.kernels`) and of the decoding step
    (:mod:`.decode`, the ``dec_*`` fields).  Field defaults are the GPU's at ``S = 128, E = 2048, C = 256`` in bf16;
    :func:`default_launch` fits them to a shape and dtype."""

    bg: int = 64  # [C, C] chunk matrices (A, dS): row tile of every kernel; 128-row tiles were slower
    bs: int = 128  # S step / tile everywhere: all of S = 128 at once, with the fused reduction's 128-row tiles
    bk: int = 64  # output / dV GEMMs' reduction step: 128-wide steps were slower
    be_fwd: int = 128  # output GEMM's E tile, on bg-row tiles (128 / 256-row GEMM tiles were slower)
    be_dv: int = 128  # dV GEMM's E tile (the output GEMM's kernel, transposed)
    be_red: int = 64  # E step of the fused reduction over E: 32-wide steps were slower
    # the fused reduction's [bg_red, bg_red] dS tiles and warps: [128, 128] with 8 warps beat [64, 64] with 4
    bg_red: int = 128
    warps_red: int = 8
    # GEMMs: 4 warps and 3 stages (the next tile's loads in flight) beat 8 warps and 2 stages
    warps_fwd: int = 4
    warps_bwd: int = 4
    stages: int = 3
    bt: int = 64  # state walk's token step: 128-token steps were slower
    # state walk's [bs_state, be_state] tiles (all of S = 128 per program): [128, 128] and [128, 32] were slower
    bs_state: int = 128
    be_state: int = 64
    warps_walk: int = 4  # 8 warps gained nothing
    seg_chunks: int = 0  # chunks per segment of the state walk, 0: by shape (:func:`.plan.seg_chunks`)
    fix_bs: int = 32  # rows of the start fix-up's [fix_bs, be_state] tiles: a little faster than 64 on long sequences
    # whole-tile TMA loads where the device and shape allow (:func:`.plan.tma_shapes`); pointer loads were slower
    tma: bool = True
    # the fused reduction's do / v / state tiles through TMA too: a little faster (measured in bf16 only)
    tma_red: bool = True
    # decoding step: a scores kernel (one program per sequence and dec_bc-slot block) then a values kernel (one
    # program per sequence and value-column block), so the keys are read and scored once per sequence
    dec_bc: int = 128  # chunk slots per block in both kernels (>= 16: tl.dot's minimum); 64 and 32 were slower
    dec_warps_scores: int = 8  # 8 warps on the scores' [128, 128] key tiles; 2 and 4 were a little slower
    dec_be: int = 32  # value columns per program: FLASH-base (E = 1536) gets 48 programs per sequence at batch 1
    dec_warps: int = 4
    # many sequences (:meth:`decode_tiles`): wider programs once the GPU is full anyway (128 and 256 were slower)
    dec_be_wide: int = 64
    dec_warps_wide: int = 4

    def thin_walk(self, n: int, H: int, S: int, E: int, device) -> MixedChunkLaunch:
        """This config with the state walk's ``S`` tile halved (once, from more than 64) where that alone gives every
        SM a walk program with one segment per sequence -- ``n`` sequences x tiles short of the SM count at
        ``bs_state``, enough at half of it -- so no segment-start fix-up runs; automatic segments only
        (``seg_chunks = 0``).  From shapes only: the forward and the backward agree.  Where halving alone does not
        make that difference, the thinner tiles were slower."""
        if self.seg_chunks or self.bs_state <= 64:
            return self
        return _thin_walk(n, H, S, E, self, str(device))

    def decode_tiles(self, N: int, E: int, device) -> tuple[int, int, int]:
        """``(chunk slots per block, value columns per program, warps)`` of the decoding step's values kernel for
        ``N`` sequences of ``E`` value columns: the wide programs once more than four programs per SM would run."""
        if N * cdiv(E, self.dec_be) > 4 * sm_count(device):
            return self.dec_bc, self.dec_be_wide, self.dec_warps_wide
        return self.dec_bc, self.dec_be, self.dec_warps


@functools.lru_cache(maxsize=64)
def _thin_walk(n, H, S, E, cfg: MixedChunkLaunch, device: str) -> MixedChunkLaunch:
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    thin = H * cdiv(S, cfg.bs_state // 2) * cdiv(E, cfg.be_state)
    if n * tiles < sm_count(torch.device(device)) <= n * thin:
        return dataclasses.replace(cfg, bs_state=cfg.bs_state // 2)
    return cfg


def default_launch(S: int, E: int, dtype: torch.dtype, C: int) -> MixedChunkLaunch:
    """The launch configuration for ``S``-wide keys, ``E``-wide values, ``dtype`` inputs and chunks of ``C`` tokens
    (cached: part of a call's host time).

    The interpreter gets 16-wide blocks and 2-chunk segments so small test shapes still cross several tiles in
    every dimension (every loop of the kernels runs more than once) and several segments per sequence, and for the
    decoding step 8-slot blocks and 16-column programs, so small test chunks and widths span several."""
    return _default_launch(S, E, dtype, C, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(S: int, E: int, dtype: torch.dtype, C: int, interp: bool) -> MixedChunkLaunch:
    if interp:
        return MixedChunkLaunch(bg=16, bs=16, bk=16, be_fwd=16, be_dv=16, be_red=16, bg_red=16, warps_red=1,
                                warps_fwd=1, warps_bwd=1, stages=1, bt=16, bs_state=16, be_state=16, seg_chunks=2,
                                fix_bs=8, dec_bc=8, dec_warps_scores=1, dec_be=16, dec_warps=1, dec_be_wide=16,
                                dec_warps_wide=1)
    common = {"bg": min(64, block(C)), "bs_state": min(128, block(S))}
    if dtype == torch.bfloat16:
        return MixedChunkLaunch(bs=min(128, block(S)), bg_red=min(128, block(C)), **common)
    # fp16 / fp32: fp32 state tiles (and fp32 inputs) in the reduction -- 128-row tiles overflow the shared memory
    # (Triton's OutOfResources), so it keeps [64, 64] tiles, 4 warps, S steps of 64, pointer loads
    return MixedChunkLaunch(bs=64, bg_red=min(64, block(C)), warps_red=4, tma_red=False, **common)
