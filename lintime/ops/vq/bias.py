"""The window bias of Transformer-VQ attention given as a relative table (``rel_bias = (qv, r)``, the layer's
Transformer-XL term): the bias of the key at distance ``m`` from its query is ``qv . r[m]`` for ``0 <= m <= L``
and 0 beyond (seed Theorem 3.6).

In the op's window layout, bias column ``c`` of the query at offset ``a`` in its block addresses the key at
distance ``m = L + a - c``.  Over the query blocks of the block layout (where row ``a`` of a block *is* offset
``a``, whatever the packing or the initial state), the window bias is therefore the ``[L, L + 1]`` table of
``qv . r[L - j]`` of each row shifted right by its row index -- a strided copy into a zeroed ``[L, 2L]`` tile
(:func:`rel_window`), where the position-by-position form (:func:`dense_rel_bias`) builds ``[T, 2L]`` int64
distance and mask tensors and gathers through them.
"""

from __future__ import annotations

import torch


def _skew_view(x: torch.Tensor, L: int) -> torch.Tensor:
    """The ``[NQ, L, H, L + 1]`` view of a contiguous ``[NQ, L, H, 2L]`` tensor whose ``[n, a, h, j]`` is
    ``x[n, a, h, a + j]`` (row ``a`` shifted right by ``a``; the rows do not overlap: ``L + 1 <= 2L``)."""
    NQ, _, H, _ = x.shape
    return x.as_strided((NQ, L, H, L + 1), (2 * L * L * H, 2 * L * H + 1, 2 * L, 1), x.storage_offset())


class _RelWindow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qr: torch.Tensor) -> torch.Tensor:
        NQ, L, H, _ = qr.shape
        out = qr.new_zeros(NQ, L, H, 2 * L)
        _skew_view(out, L).copy_(qr)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        L = grad.shape[1]
        return _skew_view(grad.contiguous(), L).contiguous()


def rel_window(qr: torch.Tensor) -> torch.Tensor:
    """``qr [NQ, L, H, L + 1]`` (row ``a`` of each block holds ``qv_a . r[L - j]`` at ``j``) -> the window bias
    ``[NQ, L, H, 2L]``: ``out[n, a, h, c] = qr[n, a, h, c - a]`` for ``0 <= c - a <= L``, else 0.  One zero fill
    and one strided copy (vq-base, bf16: 2 KB written per token and head, read by the attention kernel; the
    gradient is the strided read back)."""
    return _RelWindow.apply(qr)


def rel_table(qv: torch.Tensor, r: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """``qv [..., H, K]``, ``r [L + 1, H, K]`` -> ``[..., H, L + 1 + pad]``: ``qv . r[L - j]`` at ``j`` (distance
    ``L - j``), the table :func:`rel_window` shifts, then ``pad`` zero columns."""
    rf = r.flip(0)
    if pad:
        rf = torch.cat([rf, r.new_zeros(pad, *r.shape[1:])])
    return torch.einsum("...hk,mhk->...hm", qv, rf)


def rel_table_padded(qv: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """:func:`rel_table` with the last dimension padded to a multiple of 8 (zero columns past ``L``): the product's
    rows then start 16-byte aligned, so cuBLAS runs its aligned kernels in both directions (the unpadded ``L + 1 =
    513``-wide product ran its slower misaligned kernels).  The
    Triton kernels read it as the relative table (``REL``): column ``c`` of row ``a`` is ``table[a, c - a]``."""
    return rel_table(qv, r, -r.shape[0] % 8)


def dense_rel_bias(qv: torch.Tensor, r: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The window bias ``[B, T, H, 2L]`` position by position: ``qv [B, T, H, K]``, ``r [L + 1, H, K]``, ``offset``
    ``[B, T]`` each token's offset in its block (``pos % L``); column ``c`` gets ``qv . r[L + offset - c]`` where
    that distance lies in ``[0, L]`` (the reference forms' and one-token calls' path)."""
    L = r.shape[0] - 1
    B, T, H, _ = qv.shape
    qr = torch.einsum("bthk,mhk->bthm", qv, r)  # [B, T, H, L + 1] by distance
    m = offset[..., None] + L - torch.arange(2 * L, device=qv.device)  # [B, T, 2L]
    keep = (m >= 0) & (m <= L)
    idx = m.clamp(0, L)[:, :, None, :].expand(B, T, H, 2 * L)
    return qr.gather(-1, idx) * keep[:, :, None, :].to(qr.dtype)


def token_offsets(B: int, T: int, L: int, cu_seqlens: torch.Tensor | None, pos0: torch.Tensor | None,
                  device) -> torch.Tensor:
    """``[B, T]`` each token's offset in its block, ``pos % L``, with positions counted from each sequence's start
    (``cu_seqlens``) and continued from ``pos0`` ``[N]`` (an initial state's ``pos``), on the device."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        pos = t[None].expand(B, T) if pos0 is None else pos0.to(device)[:, None] + t[None]
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        n = torch.searchsorted(cu[1:], t, right=True)  # the sequence of each token
        pos = (t - cu[n] + (0 if pos0 is None else pos0.to(device)[n]))[None]
    return pos % L
