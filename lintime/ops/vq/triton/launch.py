"""Launch configuration of the Transformer-VQ Triton kernels: :class:`VQLaunch` and :func:`default_launch`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.kernel_launch import block, interpreting
from lintime.ops.launch_tables import LaunchConfig


@dataclass(frozen=True)
class VQLaunch(LaunchConfig):
    """Tiles and launch settings of :mod:`.kernels`.  The field defaults are tiles that ptxas (Triton 3.9, sm_90)
    compiles without spilling registers at the vq-base shape (``K = 128, V = 1536, L = S = 512``, bf16), 2026-11-27;
    :func:`default_launch` picks the measured faster launch for half inputs."""

    bm: int = 64  # forward: query rows per program
    bn: int = 64  # forward: window columns / cache codes per step
    bv: int = 128  # forward: value columns per program (the score tile is recomputed per value tile)
    warps_fwd: int = 8  # 224 registers, no spill (4 warps: 255 registers and 248 B of spills)
    bm_q: int = 64  # backward query kernel: query rows per program
    bn_q: int = 32  # backward query kernel: columns per step (64 with bv_q 64: 368 B of spills at 8 warps)
    bv_q: int = 32  # backward query kernel: V step of do . v^T
    warps_q: int = 8  # 239 registers, no spill
    bn_k: int = 64  # backward key kernel: key rows per program
    bi_k: int = 64  # backward key kernel: query rows per step
    bd_k: int = 128  # backward key kernel: output columns per program
    warps_k: int = 4  # 236 registers, no spill
    stages: int = 2


def default_launch(K: int, V: int, dtype: torch.dtype) -> VQLaunch:
    """The launch configuration for ``K``-wide keys, ``V``-wide values and ``dtype`` inputs (cached: part of a
    call's host time).

    The interpreter gets 16-wide tiles so small test shapes cross several tiles in every dimension (and every
    loop of the kernels runs more than once)."""
    return _default_launch(K, V, dtype, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(K: int, V: int, dtype: torch.dtype, interp: bool) -> VQLaunch:
    if interp:
        return VQLaunch(bm=16, bn=16, bv=16, warps_fwd=1, bm_q=16, bn_q=16, bv_q=16, warps_q=1, bn_k=16, bi_k=16,
                        bd_k=16, warps_k=1, stages=1)
    if dtype == torch.float32:
        # fp32 tiles (IEEE products): half-size tiles; ptxas still spills (fwd 440 B, query kernel 2.7 KB at
        # K = 128, sm_90, 2026-11-27) -- the fp32 path is for exactness, not speed
        return VQLaunch(bn=32, bv=min(64, block(V)), bm_q=32, bd_k=min(64, block(max(K, V))), bi_k=32, warps_k=8)
    # half inputs: the fastest launch of lab/vq_launch_ab.py at vq-base (fwd+bwd at 32k tokens with the bias:
    # 5.20 ms against 9.93 ms for the spill-free tiles, outputs and gradients within 5.3e-3 of them; H200, bf16,
    # 2026-11-27, lab/results/vq_launch_ab.json)
    return VQLaunch(bm=128, bn=32, bv=min(256, block(V)), bn_q=64, bv_q=64, bn_k=128, warps_k=8,
                    bd_k=min(128, block(max(K, V))))
