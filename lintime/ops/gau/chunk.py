"""GAU attention, tiled in PyTorch (FlashAttention-style, no T x T tensor in forward or backward).

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` query/key width, ``E`` value width,
``C`` tile (chunk) size, ``F = R * NC`` flat chunks of the per-sequence chunk layout
(:func:`lintime.ops.utils.chunk_layout`: every sequence starts a fresh tile, its last tile is
zero-padded, so tiles never cross a ``cu_seqlens`` boundary), ``P`` tile pairs on one diagonal.

The score matrix of a sequence is cut into ``C x C`` tiles.  Tile ``(c_q, c_k)`` lies on tile
diagonal ``d = c_q - c_k``; every tile of one diagonal sees the same ``C x C`` slice of the
Toeplitz bias, ``b[d * C + a - b]``.  So the loop runs over tile diagonals (``d >= 0`` when
causal -- tiles above the diagonal are never formed -- all ``d`` otherwise) and each step is
vectorised over all tile pairs of that diagonal, of all sequences at once: one step holds
``[P, H, C, C]`` scores, ``P <= F``, i.e. O(B * T * H * C) memory.

There is no normaliser (relu^2, seed Eq. 5), so tile contributions simply add up in fp32 (fp64
for fp64 inputs).  The backward pass recomputes each diagonal's scores from ``q, k, rel_bias``
instead of storing them.  With ``s = scale * q_i . k_j + b[i-j]``, ``p = relu(s)^2``:

    dv_j = sum_i p_ij do_i          dp_ij = do_i . v_j          ds_ij = 2 relu(s_ij) dp_ij
    dq_i = scale sum_j ds_ij k_j    dk_j = scale sum_i ds_ij q_i
    d rel_bias[h, (i-j) + T - 1] = sum of ds_ij along the diagonal i - j
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lintime.ops.utils import ChunkLayout, acc_dtype, chunk_layout


class _Tiles:
    """The chunk layout of one call, flattened to ``F`` tiles, with what the diagonal loop needs."""

    def __init__(self, layout: ChunkLayout, causal: bool):
        C, dev = layout.C, layout.dest.device
        self.layout = layout
        self.nc = (layout.positions()[..., 0] // C).reshape(-1)  # [F] tile number inside its sequence
        self.idx = torch.arange(self.nc.shape[0], device=dev)
        per_seq = [math.ceil(n / C) for n in layout.lengths]
        # [F] tiles of the tile's sequence (0 for the placeholder tile of an all-empty batch)
        self.nch = torch.tensor(per_seq, dtype=torch.long, device=dev)[layout.seq.reshape(-1)]
        m = max(per_seq, default=0)
        self.diagonals = range(m) if causal else range(-(m - 1), m)
        self.causal = causal
        self.upper = torch.ones(C, C, dtype=torch.bool, device=dev).triu(1)  # future keys, d == 0
        self.rel = torch.arange(C, device=dev)[:, None] - torch.arange(C, device=dev)  # [C, C] a - b
        self.span = layout.NC * C  # bias offsets of any tile pair lie in (-span, span)

    def pairs(self, d: int):
        """Query tiles ``iq`` whose key tile ``iq - d`` is in the same sequence, and the mask of
        their ``[C, C]`` score tiles (``None`` = keep all).

        Padding slots need no mask: they hold zeros (``ChunkLayout.to_chunks``), so a padded key
        adds ``relu(b)^2 * v_j = 0`` to every output, a padded query's output is never read, and
        in the backward pass their ``ds`` vanishes (``v_j = 0`` or ``do_i = 0``).
        """
        kn = self.nc - d
        iq = self.idx[(kn >= 0) & (kn < self.nch)]
        return iq, iq - d, (self.upper if self.causal and d == 0 else None)

    def bias(self, b_ext: torch.Tensor | None, d: int):
        """``[H, C, C]`` bias of the tiles on diagonal ``d`` (``b_ext`` is ``rel_bias`` zero-padded
        to offsets ``(-span, span)``), or ``None``."""
        if b_ext is None:
            return None
        return b_ext[:, self.span - 1 + d * self.layout.C + self.rel]

    def to_tiles(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """``[B, T, H, D] -> [F, H, C, D]`` in ``dt``, zero in padding slots."""
        y = self.layout.to_chunks(x.to(dt))  # [R, NC, C, H, D]
        return y.flatten(0, 1).transpose(1, 2).contiguous()

    def from_tiles(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[F, H, C, D] -> [B, T, H, D]`` in ``dtype``."""
        lay = self.layout
        _, H, C, D = y.shape
        y = y.transpose(1, 2).reshape(lay.R, lay.NC, C, H, D)
        return lay.from_chunks(y).to(dtype)


def _scores(qt, kt, bias, mask):
    """``relu(q . k + b)`` on one diagonal's tiles (``q`` pre-scaled), zero where ``mask``:
    ``[P, H, C, C]``."""
    s = torch.matmul(qt, kt.transpose(-1, -2))
    if bias is not None:
        s.add_(bias)
    s.relu_()
    return s if mask is None else s.masked_fill_(mask, 0.0)


class _GAUTiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel_bias, scale, causal, cu_seqlens, chunk_size):
        B, T = q.shape[:2]
        dt = acc_dtype(q)
        tiles = _Tiles(chunk_layout(B, T, chunk_size, cu_seqlens, q.device), causal)
        qt, kt, vt = (tiles.to_tiles(x, dt) for x in (q, k, v))  # [F, H, C, *]
        qt.mul_(scale)  # scale once per token, not once per score
        b_ext = None
        if rel_bias is not None:
            pad = tiles.span - T
            b_ext = F.pad(rel_bias.to(dt), (pad, pad))  # [H, 2 * span - 1]
        ot = torch.zeros_like(vt)  # [F, H, C, E]
        for d in tiles.diagonals:
            iq, ik, mask = tiles.pairs(d)
            r = _scores(qt[iq], kt[ik], tiles.bias(b_ext, d), mask)  # [P, H, C, C]
            ot.index_add_(0, iq, torch.matmul(r.square_(), vt[ik]))  # seed Eq. 5: relu^2 . V
        ctx.save_for_backward(q, k, v, rel_bias)
        ctx.tiles, ctx.scale = tiles, scale
        return tiles.from_tiles(ot, q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, rel_bias = ctx.saved_tensors
        tiles, scale = ctx.tiles, ctx.scale
        T = q.shape[1]
        dt = acc_dtype(q)
        qt, kt, vt, dot = (tiles.to_tiles(x, dt) for x in (q, k, v, do))
        qt.mul_(scale)
        b_ext = None
        if rel_bias is not None:
            pad = tiles.span - T
            b_ext = F.pad(rel_bias.to(dt), (pad, pad))
        need_q, need_k, need_v, need_b = ctx.needs_input_grad[:4]
        need_b = need_b and rel_bias is not None
        dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kt), torch.zeros_like(vt)
        db_ext = torch.zeros_like(b_ext) if need_b else None
        for d in tiles.diagonals:
            iq, ik, mask = tiles.pairs(d)
            q_, k_, v_, do_ = qt[iq], kt[ik], vt[ik], dot[iq]
            r = _scores(q_, k_, tiles.bias(b_ext, d), mask)  # relu(s), recomputed
            if need_v:
                dv.index_add_(0, ik, torch.matmul((r * r).transpose(-1, -2), do_))
            if not (need_q or need_k or need_b):
                continue
            ds = torch.matmul(do_, v_.transpose(-1, -2)).mul_(r).mul_(2.0)  # [P, H, C, C]
            if need_q:
                dq.index_add_(0, iq, torch.matmul(ds, k_).mul_(scale))
            if need_k:
                dk.index_add_(0, ik, torch.matmul(ds.transpose(-1, -2), q_))  # q_ carries the scale
            if need_b:
                # every tile of diagonal d shares the bias slice: sum its ds over tiles, then
                # along each within-tile diagonal a - b
                off = (tiles.span - 1 + d * tiles.layout.C + tiles.rel).reshape(-1)
                db_ext.index_add_(1, off, ds.sum(0).reshape(ds.shape[1], -1))
        db = None
        if need_b:
            pad = tiles.span - T
            db = db_ext[:, pad : pad + 2 * T - 1].to(rel_bias.dtype)
        return (
            tiles.from_tiles(dq, q.dtype) if need_q else None,
            tiles.from_tiles(dk, k.dtype) if need_k else None,
            tiles.from_tiles(dv, v.dtype) if need_v else None,
            db, None, None, None, None,
        )


def chunk_gau_attention(q, k, v, *, causal=True, rel_bias=None, scale, cu_seqlens=None, chunk_size=128):
    """Tiled GAU attention: same arguments and result as
    :func:`lintime.ops.gau.naive.naive_gau_attention`, plus ``chunk_size`` (the tile size ``C``).

    q, k: ``[B, T, H, S]``; v: ``[B, T, H, E]``; rel_bias: ``[H, 2T - 1]`` or ``None``.
    Returns ``o [B, T, H, E]`` in ``q``'s dtype.  Memory O(B * T * H * C) in forward and backward.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"gau_attention: chunk_size must be a positive int, got {chunk_size!r}")
    return _GAUTiled.apply(q, k, v, rel_bias, float(scale), bool(causal), cu_seqlens, chunk_size)
