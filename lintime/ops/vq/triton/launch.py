"""Launch configuration of the Transformer-VQ Triton kernels: :class:`VQLaunch` and :func:`default_launch`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.launching import LaunchConfig, block, interpreting


@dataclass(frozen=True)
class VQLaunch(LaunchConfig):
    """Tiles and launch settings of :mod:`.kernels`.  The field defaults are the fp32 tiles; :func:`default_launch`
    picks larger ones for half inputs."""

    # Each product kernel's tiles: rows per program, the columns it writes, the reduction step, warps.  The defaults
    # are the exact (fp32, IEEE) path's and not tuned: 64-wide tiles with 32-deep steps, modest for fp32 operands;
    # half inputs take the tuned tiles of default_launch.
    bm_p: int = 64  # probabilities: query rows per program (more rows: each loaded key tile serves more queries)
    bn_p: int = 64  # probabilities: window columns / cache codes per step (wider steps hold more scores in registers)
    warps_p: int = 4  # probabilities: 4 warps for a [64, 64] score tile (the half tuning's variants were within 2 %)
    bm_o: int = 64  # P [v; mean] and dS [k; codebook]: query rows per program (more rows: fewer value re-reads)
    bd_o: int = 64  # ... output columns per program (wider tiles re-read P fewer times; 256 won for half inputs)
    bk_o: int = 32  # ... window columns / codes per step (the reduction step: fp32 operands keep it short)
    warps_o: int = 4  # ... 4 warps for 64 x 64 fp32 tiles, 8 for the half path's 128 x 256
    bm_d: int = 64  # dS: query rows per program (rows share each loaded v tile)
    bn_d: int = 64  # dS: window columns / codes per program (256 won for half inputs: fewer re-reads of do)
    bk_d: int = 32  # dS: value columns per step of do . v^T (the reduction step, short for fp32 operands)
    warps_d: int = 4  # dS: 4 warps for 64 x 64 fp32 tiles, 8 for the half path's 128 x 256
    bn_k: int = 64  # backward key kernel: key rows per program (rows share each loaded query tile)
    bi_k: int = 32  # backward key kernel: query rows per step (the reduction step)
    bd_k: int = 64  # backward key kernel: output columns per program (the whole head up to 128 for half inputs)
    warps_k: int = 8  # backward key kernel: 8 warps for its [64, 64] fp32 accumulator (kept by the half tuning)
    stages: int = 2  # software pipelining depth of every product (3 for half inputs: their tiles take half the bytes)


def default_launch(K: int, V: int, dtype: torch.dtype) -> VQLaunch:
    """The launch configuration for ``K``-wide keys, ``V``-wide values and ``dtype`` inputs (cached: part of a
    call's host time).

    The interpreter gets 16-wide tiles so small test shapes cross several tiles in every dimension (and every
    loop of the kernels runs more than once)."""
    return _default_launch(K, V, dtype, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(K: int, V: int, dtype: torch.dtype, interp: bool) -> VQLaunch:
    if interp:
        return VQLaunch(bm_p=16, bn_p=16, warps_p=1, bm_o=16, bd_o=16, bk_o=16, warps_o=1, bm_d=16, bn_d=16,
                        bk_d=16, warps_d=1, bn_k=16, bi_k=16, bd_k=16, warps_k=1, stages=1)
    if dtype == torch.float32:
        return VQLaunch()  # the exact path (IEEE products), not the fast one: not tuned
    # half inputs: the fastest tiles at vq-base, one axis at a time from 128 x 128 x 64 products (256-wide value
    # tiles of P [v; mean] and 256 score columns per dS program won; ``docs/design/kernels.md``, Transformer-VQ)
    return VQLaunch(bm_o=128, bd_o=256, bk_o=64, warps_o=8, bm_d=128, bn_d=256, bk_d=64, warps_d=8, bn_k=128,
                    bi_k=64, bd_k=min(128, block(max(K, V))), stages=3)
