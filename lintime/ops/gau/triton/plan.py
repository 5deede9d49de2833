"""Host-side launch plans of the relu^2 region kernels: tile tables and block sizes.

Notation: ``N`` sequences, ``R`` regions (sequences for GAU, chunks for mixed chunk attention),
``NT`` tiles of ``BM`` tokens.  All tables are int32 on the inputs' device; they are built from
the sequence lengths with a handful of vectorised CPU ops and sent in one copy.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from lintime.ops.triton_common import interpreting


def pow2_at_least(x: int, lo: int = 16) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class Blocks:
    """Block sizes and launch settings.  ``bm``: tile (queries = keys); ``bs``: ``S`` step;
    ``be_fwd`` / ``be_dv``: ``E`` tile of the forward / dV kernels; ``be_red``: ``E`` step of the
    kernels that reduce over ``E``; ``bt``, ``bs_state``, ``be_state``: token step and tile of the
    chunk-state kernels; ``seg_chunks``: chunks per segment of the state pass (0 = automatic)."""

    bm: int = 64
    bs: int = 128
    be_fwd: int = 128
    be_dv: int = 128
    be_red: int = 64
    warps_fwd: int = 4
    warps_bwd: int = 4
    stages: int = 2
    bt: int = 64
    bs_state: int = 64
    be_state: int = 64
    seg_chunks: int = 0

    def to_list(self) -> list[int]:
        return list(astuple(self))

    @classmethod
    def from_list(cls, xs) -> Blocks:
        return cls(*[int(x) for x in xs])


def default_blocks(S: int, E: int, dtype: torch.dtype) -> Blocks:
    """Block sizes for ``S``-wide keys and ``E``-wide values.

    The interpreter gets 16-wide blocks so small test shapes still cross several tiles in every
    dimension (and every loop of the kernels runs more than once); on the GPU the sizes follow
    the measurements in ``docs/notes/kernels_flash.md``.
    """
    if interpreting():
        return Blocks(bm=16, bs=16, be_fwd=16, be_dv=16, be_red=16, warps_fwd=1, warps_bwd=1, stages=1,
                      bt=16, bs_state=16, be_state=16, seg_chunks=2)
    bs = min(128, pow2_at_least(S))
    wide = dtype != torch.float32
    return Blocks(
        bm=64, bs=bs, be_fwd=128 if wide else 64, be_dv=128 if wide else 64, be_red=64, warps_fwd=4, warps_bwd=4,
        stages=2, bt=64, bs_state=64, be_state=64, seg_chunks=0,
    )


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``starts [N]``, ``lengths [N]`` (int64, CPU) of the sequences in the flattened ``[B * T]``
    token order."""
    if cu_seqlens is None:
        starts = torch.arange(B, dtype=torch.long) * T
        return starts, torch.full((B,), T, dtype=torch.long)
    cu = cu_seqlens.detach().to("cpu", torch.long)
    return cu[:-1].clone(), cu[1:] - cu[:-1]


def tiles_of(reg_len: torch.Tensor, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``TILE_REG [NT]``, ``TILE_OFF [NT]``: the ``bm``-token tiles of every region (CPU int64)."""
    nt = (reg_len + bm - 1) // bm
    reg = torch.repeat_interleave(torch.arange(reg_len.numel()), nt)
    first = torch.cumsum(nt, 0) - nt
    off = (torch.arange(reg.numel()) - first[reg]) * bm
    return reg, off


def to_device(device, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Int tables to ``device`` as int32, in one host-to-device copy."""
    sizes = [x.numel() for x in xs]
    flat = torch.cat([x.reshape(-1).to(torch.int32) for x in xs]) if xs else torch.zeros(0, dtype=torch.int32)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(torch.split(flat, sizes))


def fold_bias_grad(db_tiles: torch.Tensor, LB: int, OFF: int, bm: int) -> torch.Tensor:
    """``[H, NTD, BM, BM]`` per-tile-diagonal sums of ``ds`` -> ``[H, LB]`` bias gradient, with
    entry ``(td, a, b)`` at bias index ``OFF + (td - mid) * bm + a - b``."""
    H, NTD = db_tiles.shape[:2]
    mid = (NTD - 1) // 2
    dev = db_tiles.device
    td = torch.arange(NTD, device=dev)[:, None, None]
    a = torch.arange(bm, device=dev)
    idx = OFF + (td - mid) * bm + (a[:, None] - a[None, :])  # [NTD, BM, BM]
    ok = (idx >= 0) & (idx < LB)
    out = torch.zeros(H, LB, dtype=db_tiles.dtype, device=dev)
    return out.index_add_(1, idx[ok], db_tiles[:, ok])
