"""Textbook GAU / FLASH heads (FLASH seed Codes 3, 6, 8): silu, split, per-dimension scale and
offset, RoPE -- one head and one RoPE group at a time, in fp32 (fp64 for fp64 inputs), with the
rotation written out.  Gradients come from autograd."""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype


def naive_gau_heads(h, gamma, beta, positions, *, e, s, gating=True, rope_base=10000.0, rope_heads=1,
                    split_heads=False, bias=None):
    """``u, v, z = split(silu(h + bias))``; ``heads[:, :, n] = rope(z * gamma[n] + beta[n])`` with RoPE
    over each of the ``rope_heads`` groups of ``D = s / rope_heads`` features.

    h: ``[B, T, 2e + s]`` (``[B, T, e + s]`` without gating); gamma, beta: ``[nh, s]`` (rounded to
    ``h``'s dtype first, like the layers' ScaleOffset); positions: ``[B, T]`` int; bias: ``None`` or ``[W]``
    (rounded to ``h``'s dtype first, added in the compute precision).
    Returns ``u [B, T, e]`` (``None`` without gating), ``v [B, T, e]``, ``heads [B, T, nh, s]`` (with
    ``split_heads`` a tuple of ``nh`` ``[B, T, 1, s]`` tensors) in ``h``'s dtype.
    """
    dt = acc_dtype(h)
    x = h.to(dt) if bias is None else h.to(dt) + bias.to(h.dtype).to(dt)
    a = x * torch.sigmoid(x)  # silu (seed Code 6)
    u = a[..., :e] if gating else None
    v = a[..., e : 2 * e] if gating else a[..., :e]
    z = a[..., -s:]  # [B, T, s]
    g, b = gamma.to(h.dtype).to(dt), beta.to(h.dtype).to(dt)
    D = s // rope_heads
    half = D // 2
    ang = positions.to(dt)[..., None] * rope_base ** -(torch.arange(half, device=h.device, dtype=dt) / half)
    cos, sin = ang.cos(), ang.sin()  # [B, T, D/2]
    heads = []
    for n in range(gamma.shape[0]):
        q = z * g[n] + b[n]  # seed Code 6: scale + offset
        groups = []
        for r in range(rope_heads):  # seed Code 3 on each group, the two-halves layout
            x1, x2 = q[..., r * D : r * D + half], q[..., r * D + half : (r + 1) * D]
            groups += [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        heads.append(torch.cat(groups, -1).to(h.dtype))
    out = tuple(q[:, :, None] for q in heads) if split_heads else torch.stack(heads, -2)  # [B, T, (1 or nh), s]
    return (None if u is None else u.to(h.dtype)), v.to(h.dtype), out
