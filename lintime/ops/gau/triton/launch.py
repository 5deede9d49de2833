"""GAU attention's launch configuration (:class:`GauLaunch`, :func:`default_launch`) and the tiled kernels'
host-side tables (tiles of each region, the bias as one tile per tile diagonal).

What chose the defaults: ``docs/design/kernels.md`` (GAU attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, block, interpreting


@dataclass(frozen=True)
class GauLaunch(LaunchConfig):
    """Block sizes and launch settings of GAU's kernels: the tiled kernels (:mod:`.kernels`) and the slab path
    (:mod:`.slab`).  Field defaults are the GPU's at ``S = 128, E = 2048``; :func:`default_launch` fits them to a
    shape."""

    # tiled kernels
    bm: int = 64  # query = key tile: 128-row tiles (8 warps) were slower
    bs: int = 128  # S step: all of S = 128 at once (the TMA path loads q / k tiles whole; dq stays in registers)
    # forward E tile: the scores are recomputed per E tile, so wide tiles recompute them a quarter as often as 128
    be_fwd: int = 512
    be_dv: int = 512  # dV kernel's E tile: wide for the same reason (the scores are recomputed per tile)
    be_red: int = 128  # dq/dk kernel's E step over do . v: 64-wide steps were slower
    warps: int = 4  # dq/dk kernel: 8 warps were slower
    warps_fwd: int = 8  # with the 512-wide forward tiles (measured together with be_fwd)
    warps_dv: int = 8  # with the 512-wide dV tiles (measured together with be_dv)
    stages: int = 2  # all three kernels: the next tile's loads overlap this one's products
    # whole-tile TMA loads where the device and shape allow (:func:`.gau._tma`): faster than pointer loads
    tma: bool = True
    # slab path: rows per slab (0: the tiled kernels); the E-wide products run as cuBLAS GEMMs, faster than tiles
    slab: int = 512
    slab_max: int = 2048  # slabs grow on long sequences up to this (:func:`.slab.slab_rows`): fewer, longer GEMMs
    bm_slab: int = 64  # slab kernels' score tile: [128, 128] tiles with 8 warps were slower
    warps_slab: int = 4  # enough for a [64, 64] score tile; 8 warps were slower
    # packed rows by slabs with the pairs across sequences masked (:func:`.slab.packed_rows`): 0 never, 1 where
    # cheaper than the tiled kernels, 2 always (tests)
    slab_masked: int = 1

def default_launch(S: int, E: int) -> GauLaunch:
    """The launch configuration for ``S``-wide keys and ``E``-wide values (cached: part of a call's host time).

    The interpreter gets 16-wide blocks so small test shapes still cross several tiles in every dimension (and
    every loop of the kernels runs more than once), and the slab path from ``E >= 16`` (the GPU rule, ``E >=
    512``, at the interpreter's widths) so tests of narrow and wide values run both paths."""
    return _default_launch(S, E, interpreting())


@functools.lru_cache(maxsize=64)
def _default_launch(S: int, E: int, interp: bool) -> GauLaunch:
    if interp:
        return GauLaunch(bm=16, bs=16, be_fwd=16, be_dv=16, be_red=16, warps=1, warps_fwd=1, warps_dv=1, stages=1,
                         slab=32 if E >= 16 else 0, slab_max=0, bm_slab=16, warps_slab=1)
    return GauLaunch(bs=min(128, block(S)), slab=512 if E >= 512 else 0)


def tiles_of(reg_len: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``TILE_REG [NT]``, ``TILE_OFF [NT]``: the ``bm``-token tiles of every region (CPU int64)."""
    nt = (reg_len + bm - 1) // bm
    reg = torch.repeat_interleave(torch.arange(reg_len.numel()), nt)
    first = torch.cumsum(nt, 0) - nt
    off = (torch.arange(reg.numel()) - first[reg]) * bm
    return reg, off


def bias_tiles(bias: torch.Tensor | None, ntd: int, OFF: int, bm: int) -> torch.Tensor | None:
    """The bias ``[H, LB]`` as one ``[bm, bm]`` tile per tile diagonal, ``[H, ntd, bm, bm]`` (the kernels'
    :func:`~lintime.ops.gau.triton.kernels._bias_tile`): entry ``(td, a, b)`` is ``bias[h, OFF + (td - mid) bm
    + a - b]``, 0 outside ``[0, LB)`` (rows / columns past a region, never used unmasked).  Two small gathers
    per pass; about ``2 T / bm`` tiles (1 MB in fp32 at T = 4k, bm = 64)."""
    if bias is None:
        return None
    idx, ok = tile_index(ntd, bias.shape[1], OFF, bm, bias.device)
    return torch.where(ok, bias[:, idx], torch.zeros((), dtype=bias.dtype, device=bias.device)).view(
        bias.shape[0], ntd, bm, bm)


@functools.lru_cache(maxsize=32)
def tile_index(ntd: int, LB: int, OFF: int, bm: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather of :func:`bias_tiles`: bias indices (clamped) and which of them fall inside ``[0, LB)``."""
    mid = (ntd - 1) // 2
    td = torch.arange(ntd, device=device)[:, None, None]
    a = torch.arange(bm, device=device)
    idx = (OFF + (td - mid) * bm + (a[:, None] - a[None, :])).reshape(-1)
    ok = (idx >= 0) & (idx < LB)
    return idx.clamp(0, LB - 1), ok
