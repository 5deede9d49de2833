"""Positional pieces shared by the mixers and the models (FLASH seed Codes 2-4).

* :func:`token_positions` -- the ``[B, T]`` position of every token inside its sequence
  (restarting at ``cu_seqlens`` boundaries, continuing from a decoding offset);
* :class:`ScaledSinEmbedding` -- absolute sinusoid times a learned scalar (Code 2);
* :class:`LearnedPositionEmbedding` -- absolute learned table (Gehring et al.);
* :func:`apply_rope` / :class:`RoPE` -- rotary embedding on ``[B, T, H, D]`` (Code 3);
* :class:`ToeplitzRelativeBias` -- relative position bias as Toeplitz diagonals (Code 4).

Sinusoids are computed in fp64 for fp64 inputs and fp32 otherwise, then cast to the input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lintime.ops.utils import rope, rope_inv_freq


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_positions(
    batch_size: int,
    seq_len: int,
    *,
    offset: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[B, T]`` int64 position of each token inside its own sequence.

    ``offset``: ``[N]`` tokens each sequence has already consumed (decoding), ``None`` = 0;
    ``N = B`` without packing, the number of packed sequences with ``cu_seqlens`` (``B == 1``).
    Packed sequences restart at ``offset[n]`` at each boundary.
    """
    t = torch.arange(seq_len, device=device)
    if cu_seqlens is None:
        pos = t.expand(batch_size, seq_len)
        if offset is not None:
            pos = pos + offset.to(device=t.device, dtype=torch.long)[:, None]
        return pos
    if batch_size != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (packed), got B={batch_size}")
    cu = cu_seqlens.to(device=t.device, dtype=torch.long)
    seq = torch.searchsorted(cu, t, right=True) - 1  # [T] sequence of each token (cu[0] = 0 <= t)
    pos = t - cu.index_select(0, seq)
    if offset is not None:
        pos = pos + offset.to(device=t.device, dtype=torch.long).index_select(0, seq)
    return pos[None]


def sinusoid(positions: torch.Tensor, dim: int, dtype: torch.dtype, base: float = 10000.0) -> torch.Tensor:
    """``[*P, dim]``: ``[sin(p * f), cos(p * f)]`` with ``f_i = base ** (-i / (dim/2))`` (seed Code 2)."""
    half = dim // 2
    adt = _angle_dtype(dtype)
    ang = positions.to(adt)[..., None] * rope_inv_freq(half, base, adt, positions.device)
    return torch.cat([ang.sin(), ang.cos()], dim=-1).to(dtype)


class ScaledSinEmbedding(nn.Module):
    """Absolute sinusoidal embedding times one learned scalar initialised to ``1/sqrt(d)``
    (seed Code 2, "ScaledSin")."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"ScaledSin needs an even model width, got {dim}")
        self.dim, self.base = dim, base
        self.scale = nn.Parameter(torch.full((), 1.0 / math.sqrt(dim)))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``positions [B, T]`` -> ``[B, T, dim]``."""
        return self.scale.to(dtype) * sinusoid(positions, self.dim, dtype, self.base)

    def extra_repr(self) -> str:
        return f"{self.dim}, base={self.base}"


class LearnedPositionEmbedding(nn.Module):
    """Absolute learned position table ``[max_positions, dim]`` (Gehring et al. 2017)."""

    def __init__(self, max_positions: int, dim: int):
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.zeros(max_positions, dim))
        self.init_weights(0.02)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype | None = None, *,
                max_position: int | None = None) -> torch.Tensor:
        """``positions [*P]`` int64 -> ``[*P, dim]``.  ``max_position``: a host-side upper bound of
        ``positions`` known to the caller (e.g. a decoding step's offset); when it lies inside the
        table, the range check needs no device->host read."""
        if max_position is not None and max_position < self.max_positions:
            return self.weight[positions]
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is beyond the learned position table "
                f"(max_positions={self.max_positions})"
            )
        return self.weight[positions]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (seed Code 3), the two-halves layout.

    ``x``: ``[*P, H, D]`` (``[B, T, H, D]`` for attention) with even ``D``;
    ``positions``: ``[*P]`` (``[B, T]``), any integers (negative ones too).
    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]`` with angle ``p * base ** (-i / (D/2))``,
    so ``rope(q, i) . rope(k, j)`` depends on ``i - j`` only.
    """
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"RoPE needs an even feature size, got {D}")
    return rope(x, positions[..., None], base)  # positions [*P, 1] against x's [*P, H]


class RoPE(nn.Module):
    """Module wrapper of :func:`apply_rope` (no parameters)."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even feature size, got {dim}")
        self.dim, self.base = dim, base

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, positions, self.base)

    def extra_repr(self) -> str:
        return f"{self.dim}, base={self.base}"


class ToeplitzRelativeBias(nn.Module):
    """Relative position bias ``b[i - j]`` (seed Code 4), returned as Toeplitz diagonals in the
    layout of docs/design/contract.md §2.2 / §2.3: ``diagonals(T)[h, (i - j) + T - 1]`` is the bias of query ``i``
    and key ``j``.

    * ``max_len < threshold`` (512): a direct parameter ``[H, 2 * max_len - 1]``; calls with
      ``T <= max_len`` read its middle ``2T - 1`` entries, so the bias of an offset never
      depends on the call length (decoding matches training).  The seed indexes its vector by
      ``j - i``; ours is the same parameter read backwards (the contract's ``i - j`` layout).
    * otherwise: built from two vectors ``a, b [H, rope_dim]`` as
      ``b[i - j] = rope(a, i) . rope(b, j) = rope(a, i - j) . b`` (any ``T``).

    Both are initialised ``N(0, 0.02)`` like the seed.
    """

    def __init__(self, max_len: int, heads: int = 1, *, rope_dim: int = 128, threshold: int = 512,
                 std: float = 0.02):
        super().__init__()
        if max_len < 1:
            raise ValueError(f"ToeplitzRelativeBias: max_len must be >= 1, got {max_len}")
        self.max_len, self.heads = max_len, heads
        self.mode = "direct" if max_len < threshold else "rope"
        if self.mode == "direct":
            self.weight = nn.Parameter(torch.randn(heads, 2 * max_len - 1) * std)
        else:
            self.a = nn.Parameter(torch.randn(heads, rope_dim) * std)
            self.b = nn.Parameter(torch.randn(heads, rope_dim) * std)

    def diagonals(self, T: int) -> torch.Tensor:
        """``[H, 2T - 1]``, entry ``(i - j) + T - 1`` is the bias of query ``i``, key ``j``."""
        if self.mode == "direct":
            n = self.max_len
            if T > n:
                raise ValueError(f"ToeplitzRelativeBias(direct) holds offsets up to {n - 1}, asked for T={T}")
            return self.weight[:, n - T : n + T - 1]
        delta = torch.arange(-(T - 1), T, device=self.a.device)  # [2T-1] offsets i - j
        a = apply_rope(self.a[None].expand(2 * T - 1, -1, -1), delta)  # [2T-1, H, R]
        return torch.einsum("dhr,hr->hd", a, self.b)

    def no_weight_decay(self) -> set[str]:
        # a bias table, not a projection: like other biases it is not decayed
        return {name for name, _ in self.named_parameters()}

    def matrix(self, T: int) -> torch.Tensor:
        """``[H, T, T]`` dense bias ``B[h, i, j]`` (for references and tests)."""
        d = self.diagonals(T)
        idx = torch.arange(T, device=d.device)
        return d[:, idx[:, None] - idx[None, :] + T - 1]

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, heads={self.heads}, mode={self.mode}"
