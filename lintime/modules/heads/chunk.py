"""GAU / FLASH heads as PyTorch composites (any device), autograd for the gradients.

This is, operation for operation, what the GAU and FLASH layers computed before the op existed:
``F.silu`` on the whole projection, ``split``, the ScaleOffset product and sum in ``h``'s dtype,
then RoPE with its angles in fp32 (fp64 for fp64 inputs) and the result cast back -- so on the
CPU the layers give exactly their former outputs.  Half-precision inputs round after each step
(silu, product, sum, rotation); the fused kernel rounds only once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.ops.utils import rope


def rope_groups(x: torch.Tensor, positions: torch.Tensor, base: float, groups: int) -> torch.Tensor:
    """RoPE (seed Code 3, two-halves layout) on ``x [B, T, nh, s]``, each of the ``groups`` runs of
    ``D = s / groups`` features rotated on its own (:func:`lintime.ops.utils.rope`), the result in
    ``x``'s dtype."""
    xg = x.unflatten(-1, (groups, x.shape[-1] // groups))  # [B, T, nh, groups, D]
    return rope(xg, positions[..., None, None], base).flatten(-2)  # positions [B, T, 1, 1]


def chunk_gau_heads(h, gamma, beta, positions, *, e, s, gating=True, rope_base=10000.0, rope_heads=1,
                    split_heads=False, bias=None):
    """Same arguments and results as :func:`lintime.modules.heads.naive.naive_gau_heads`; ``u``
    and ``v`` (and with ``split_heads`` each head) are contiguous copies of their slices; the bias is added in
    ``h``'s dtype (as a product's epilogue rounds it)."""
    a = F.silu(h if bias is None else h + bias.to(h.dtype))
    if gating:
        u, v, z = a.split([e, e, s], dim=-1)  # [B, T, e], [B, T, e], [B, T, s]
    else:
        u, (v, z) = None, a.split([e, s], dim=-1)
    q = z[..., None, :] * gamma.to(z.dtype) + beta.to(z.dtype)  # [B, T, nh, s], the layers' ScaleOffset
    heads = rope_groups(q, positions, rope_base, rope_heads)
    if split_heads:
        heads = tuple(x.contiguous() for x in heads.split(1, dim=2))  # [B, T, 1, s] each
    return (None if u is None else u.contiguous()), v.contiguous(), heads
