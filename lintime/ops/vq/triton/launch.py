"""Launch configuration of the Transformer-VQ Triton kernels: :class:`VQLaunch` and :func:`default_launch`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lintime.ops.kernel_launch import block, interpreting
from lintime.ops.launch_tables import LaunchConfig


@dataclass(frozen=True)
class VQLaunch(LaunchConfig):
    """Tiles and launch settings of :mod:`.kernels`; field defaults are meant for the vq-base shape (``K = 128,
    V = 1536, L = S = 512``, bf16).  Not tuned yet: FlashAttention-2's tiles for 128-wide heads, unmeasured."""

    bm: int = 64  # forward: query rows per program
    bn: int = 64  # forward: window columns / cache codes per step
    bv: int = 128  # forward: value columns per program (the score tile is recomputed per value tile)
    warps_fwd: int = 4
    bm_q: int = 64  # backward query kernel: query rows per program
    bn_q: int = 64  # backward query kernel: columns per step
    bv_q: int = 64  # backward query kernel: V step of do . v^T
    warps_q: int = 4
    bn_k: int = 64  # backward key kernel: key rows per program
    bi_k: int = 64  # backward key kernel: query rows per step
    bd_k: int = 128  # backward key kernel: output columns per program
    warps_k: int = 4
    stages: int = 2


def default_launch(K: int, V: int) -> VQLaunch:
    """The launch configuration for ``K``-wide keys and ``V``-wide values (cached: part of a call's host time).

    The interpreter gets 16-wide tiles so small test shapes cross several tiles in every dimension (and every
    loop of the kernels runs more than once)."""
    return _default_launch(K, V, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(K: int, V: int, interp: bool) -> VQLaunch:
    if interp:
        return VQLaunch(bm=16, bn=16, bv=16, warps_fwd=1, bm_q=16, bn_q=16, bv_q=16, warps_q=1, bn_k=16, bi_k=16,
                        bd_k=16, warps_k=1, stages=1)
    # value tiles no wider than the values; 128 keeps the [64, 128] fp32 accumulator in registers
    bv = min(128, block(V))
    return VQLaunch(bv=bv, bd_k=min(128, block(max(K, V))))
