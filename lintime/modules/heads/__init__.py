"""GAU / FLASH heads: the elementwise "prologue" between a GAU-style layer's input projection and
its attention -- silu, split into ``u, v, z``, per-dimension scale + offset heads, RoPE."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.modules.heads.chunk import chunk_gau_heads
from lintime.modules.heads.naive import naive_gau_heads
from lintime.ops.utils import FLOAT_DTYPES

_IMPLS = {"naive": naive_gau_heads, "chunk": chunk_gau_heads}
MAX_SPLIT_HEADS = 6  # the fused kernel's head pointer arguments (FLASH with first-to-all has 6 heads)


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.modules.heads.triton import triton_gau_heads

    return triton_gau_heads


register_triton(_IMPLS, _load_triton)


def _check(op, h, gamma, beta, positions, e, s, gating, rope_base, rope_heads, split_heads, bias):
    for name, val in (("e", e), ("s", s), ("rope_heads", rope_heads)):
        if not isinstance(val, Integral) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {val!r}")
    for name, val in (("gating", gating), ("split_heads", split_heads)):
        if not isinstance(val, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {type(val).__name__}")
    if not isinstance(rope_base, Real) or isinstance(rope_base, bool) or not math.isfinite(rope_base) or rope_base <= 0:
        raise ValueError(f"{op}: rope_base must be a positive finite number, got {rope_base!r}")
    if s % rope_heads or (s // rope_heads) % 2:
        raise ValueError(f"{op}: rope_heads={rope_heads} must cut s={s} into groups of even size")
    for name, x in (("h", h), ("gamma", gamma), ("beta", beta), ("positions", positions)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != h.device:
            raise ValueError(f"{op}: {name} is on {x.device}, h on {h.device}")
    for name, x in (("h", h), ("gamma", gamma), ("beta", beta)):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be a floating tensor, got {x.dtype}")
    if h.dim() != 3:
        raise ValueError(f"{op}: h must be [B, T, W], got shape {tuple(h.shape)}")
    B, T, W = h.shape
    want = (2 * e if gating else e) + s
    if W != want:
        raise ValueError(f"{op}: h's last dim must be {'2e' if gating else 'e'} + s = {want}, got {W}")
    if gamma.dim() != 2 or gamma.shape[1] != s or beta.shape != gamma.shape:
        raise ValueError(f"{op}: gamma and beta must both be [nh, s={s}], got {tuple(gamma.shape)} and {tuple(beta.shape)}")
    if split_heads and gamma.shape[0] > MAX_SPLIT_HEADS:
        raise ValueError(f"{op}: split_heads takes at most {MAX_SPLIT_HEADS} heads, got nh={gamma.shape[0]}")
    if positions.shape != (B, T) or positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"{op}: positions must be an int tensor [B, T] = {[B, T]}, got {positions.dtype} {tuple(positions.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: bias must be a floating tensor, got {bias.dtype}")
        if bias.device != h.device:
            raise ValueError(f"{op}: bias is on {bias.device}, h on {h.device}")
        if bias.shape != (W,):
            raise ValueError(f"{op}: bias must be [W] = [{W}] (h's last dim), got {tuple(bias.shape)}")


def gau_heads(
    h: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    positions: torch.Tensor,
    *,
    e: int,
    s: int,
    gating: bool = True,
    rope_base: float = 10000.0,
    rope_heads: int = 1,
    split_heads: bool = False,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
    """The heads of a GAU / FLASH layer from its projection (FLASH seed Codes 6 and 8)::

        u, v, z = split(silu(h + bias), [e, e, s])          # (v, z without gating; no bias: 0)
        heads[:, :, n] = rope(z * gamma[n] + beta[n])       # n = 0 .. nh - 1

    RoPE (seed Code 3, two-halves layout ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``,
    angle ``p * rope_base ** (-i / (D/2))`` in fp32, fp64 for fp64 ``h``) rotates each of the
    ``rope_heads`` consecutive groups of ``D = s / rope_heads`` features on its own: GAU with ``H``
    attention heads passes ``rope_heads=H``, FLASH ``1``.

    Args:
        h: ``[B, T, 2e + s]`` (``[B, T, e + s]`` when ``gating=False``), the input projection
            before its activation; fp16 / bf16 / fp32 / fp64.
        gamma, beta: ``[nh, s]`` scale and offset of the ``nh`` heads (FLASH: 4, 6 with
            first-to-all; GAU: 2), any float dtype: rounded to ``h``'s dtype first, like the
            layers' ScaleOffset (under autocast ``h`` is bf16 while they are fp32).
        positions: ``[B, T]`` int, each token's RoPE position (any integers, negative too); not
            differentiable.
        e, s: expanded width and shared key width.
        gating: ``h`` holds ``u`` (GAU Table 1 "no gating": it does not).
        rope_base: RoPE base.
        rope_heads: RoPE groups in ``s``; ``s / rope_heads`` must be even.
        split_heads: return the heads as ``nh <= 6`` separate contiguous ``[B, T, 1, s]`` tensors (the
            attention ops' inputs), which the fused kernel writes directly and whose gradients it reads
            as they are (any of them may be ``None``): no copies either way.
        bias: ``None`` or ``[W]`` (``W = h.shape[-1]``), the input projection's bias, any float dtype: rounded to
            ``h``'s dtype and added before the activation (in fp32 in the fused kernel, in ``h``'s dtype in
            ``"chunk"``, as the product's epilogue rounds).  A layer that runs its projection without the bias
            and passes it here gets the bias gradient from the fused backward's registers (the column sums of
            the pre-activation's gradient) instead of a separate pass over that gradient.
        backend: ``None`` (automatic: ``"triton"`` for CUDA tensors when Triton is installed, else
            ``"chunk"``), ``"naive"`` (textbook, fp32), ``"chunk"`` (PyTorch composite: the
            layers' former eager math) or ``"triton"`` (one fused kernel each way; CPU tensors
            only under ``TRITON_INTERPRET=1``; fp64 goes to ``"chunk"``).
    Returns:
        ``u [B, T, e]`` (``None`` without gating), ``v [B, T, e]``, ``heads [B, T, nh, s]`` (with
        ``split_heads`` a tuple of ``nh`` ``[B, T, 1, s]``, equal to ``heads[:, :, n : n + 1]``): all
        contiguous, in ``h``'s dtype.  Gradients flow to ``h``, ``gamma``, ``beta`` and ``bias`` (in their
        own dtypes; the fused kernel accumulates ``gamma``'s, ``beta``'s and ``bias``'s in fp32).
    """
    op = "gau_heads"
    _check(op, h, gamma, beta, positions, e, s, gating, rope_base, rope_heads, split_heads, bias)
    impl = select(op, backend, _IMPLS, h)
    return impl(h, gamma, beta, positions, e=int(e), s=int(s), gating=gating, rope_base=float(rope_base),
                rope_heads=int(rope_heads), split_heads=split_heads, bias=bias)


__all__ = ["gau_heads"]
