"""The layer's output gate ``y = o * silu(g_pre)`` (seed Eqs. 11 and 14) as one kernel each way: the custom ops
``lintime::vq_gate`` / ``lintime::vq_gate_bwd``.

The PyTorch form is three passes forward (SiLU, then the product; the SiLU's output kept for the backward) and
three backward (two products, the SiLU's gradient): vq-base at 32k tokens, bf16, per layer and step, about 0.5 GB
forward and 0.9 GB backward of ``[T, D_v]`` traffic, where these kernels move 0.3 GB and 0.5 GB (counted from the
tensor sizes; not timed).  The SiLU and the product are formed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lintime.ops.utils.launching import cdiv, grad_as, launcher_op
from lintime.ops.vq.triton.launch import default_launch


@triton.jit
def vq_gate_fwd_kernel(o, g, y, M, stride_g, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr):
    """``y = o * g * sigmoid(g)`` on a ``[BM, BE]`` tile (``o``, ``y`` rows of ``E``; ``g`` rows ``stride_g``
    apart); grid ``(cdiv(M, BM), cdiv(E, BE))``."""
    i_m, i_e = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_e = i_e * BE + tl.arange(0, BE)
    m = (o_m < M)[:, None] & (o_e < E)[None, :]
    b_o = tl.load(o + o_m[:, None] * E + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + o_m[:, None] * stride_g + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = b_o * (b_g * tl.sigmoid(b_g))
    tl.store(y + o_m[:, None] * E + o_e[None, :], b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def vq_gate_bwd_kernel(dy, o, g, do, dg, M, stride_g, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr):
    """``do = dy * silu(g)``, ``dg = dy * o * sigmoid(g) (1 + g (1 - sigmoid(g)))`` (``dg`` rows of ``E``)."""
    i_m, i_e = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_e = i_e * BE + tl.arange(0, BE)
    m = (o_m < M)[:, None] & (o_e < E)[None, :]
    p = o_m[:, None] * E + o_e[None, :]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_o = tl.load(o + p, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + o_m[:, None] * stride_g + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    tl.store(do + p, (b_dy * b_g * b_s).to(do.dtype.element_ty), mask=m)
    tl.store(dg + p, (b_dy * b_o * b_s * (1.0 + b_g * (1.0 - b_s))).to(dg.dtype.element_ty), mask=m)


def _tiles(E: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BM, BE)`` for rows of ``E``: :meth:`.launch.VQLaunch.gate_tiles`."""
    return default_launch(0, E, dtype).gate_tiles(E)


def _grid(M: int, E: int, dtype: torch.dtype):
    BM, BE = _tiles(E, dtype)
    return (cdiv(M, BM), cdiv(E, BE)), BM, BE


@launcher_op("vq_gate_bwd", fake=lambda dy, o, g: (torch.empty_like(o), torch.empty_like(o, dtype=g.dtype)))
def vq_gate_bwd_op(dy: Tensor, o: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(do [M, E], dg [M, E])`` (``dg`` contiguous, in ``g``'s dtype)."""
    M, E = o.shape
    do, dg = torch.empty_like(o), torch.empty_like(o, dtype=g.dtype)
    grid, BM, BE = _grid(M, E, o.dtype)
    if M > 0:
        vq_gate_bwd_kernel[grid](dy, o, g, do, dg, M, g.stride(0), E=E, BM=BM, BE=BE)
    return do, dg


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    if dy is None:
        return None, None
    o, g = ctx.saved_tensors
    return vq_gate_bwd_op.for_ctx(ctx)(grad_as(dy, o.dtype).contiguous(), o, g)


@launcher_op("vq_gate", fake=lambda o, g: torch.empty_like(o), backward=_backward, setup_context=_setup)
def vq_gate_op(o: Tensor, g: Tensor) -> Tensor:
    """``o * silu(g)`` for ``o`` ``[M, E]`` contiguous and ``g`` ``[M, E]`` with unit column stride."""
    M, E = o.shape
    y = torch.empty_like(o)
    grid, BM, BE = _grid(M, E, o.dtype)
    if M > 0:
        vq_gate_fwd_kernel[grid](o, g, y, M, g.stride(0), E=E, BM=BM, BE=BE)
    return y


def triton_vq_gate(o: Tensor, g_pre: Tensor) -> Tensor:
    """``o * silu(g_pre)`` (same shapes ``[..., E]``, same dtype) on the kernels above."""
    E = o.shape[-1]
    g2 = g_pre.reshape(-1, E)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    return vq_gate_op(o.reshape(-1, E).contiguous(), g2).view(o.shape)


@triton.jit
def vq_silu_bwd_kernel(dy, z, dz, R, M, stride_a, stride_m, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr):
    """``dz = dy * sigmoid(z) (1 + z (1 - sigmoid(z)))`` for ``R`` rows of ``E`` (``z``, ``dz`` contiguous); ``dy`` row
    ``r`` at ``(r // M) stride_a + (r % M) stride_m``.  Grid ``(cdiv(R, BM), cdiv(E, BE))``."""
    i_m, i_e = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_e = i_e * BE + tl.arange(0, BE)
    m = (o_m < R)[:, None] & (o_e < E)[None, :]
    rows = (o_m // M) * stride_a + (o_m % M) * stride_m
    b_dy = tl.load(dy + rows[:, None] + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(z + o_m[:, None] * E + o_e[None, :], mask=m, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(b_z)
    tl.store(dz + o_m[:, None] * E + o_e[None, :], (b_dy * b_s * (1.0 + b_z * (1.0 - b_s))).to(dz.dtype.element_ty),
             mask=m)


@launcher_op("vq_silu_bwd", fake=lambda dy, z: torch.empty_like(z))
def vq_silu_bwd_op(dy: Tensor, z: Tensor) -> Tensor:
    """``dz`` (``z``'s shape ``[A, M, E]``, contiguous) from ``dy`` ``[A, M, E]`` with unit stride in ``E`` and rows of
    any stride within and across its first dimension (the block layout's slice of the values' gradient)."""
    A, M, E = z.shape
    dz = torch.empty_like(z)
    BM, BE = _tiles(E, z.dtype)
    if A * M > 0:
        vq_silu_bwd_kernel[(cdiv(A * M, BM), cdiv(E, BE))](dy, z, dz, A * M, M, dy.stride(0), dy.stride(1), E=E, BM=BM,
                                                           BE=BE)
    return dz


def _silu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_backward(ctx, dy):
    if dy is None:
        return None
    (z,) = ctx.saved_tensors
    dy = grad_as(dy, z.dtype)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    return vq_silu_bwd_op.for_ctx(ctx)(dy, z)


@launcher_op("vq_silu", fake=lambda z: torch.empty_like(z), backward=_silu_backward, setup_context=_silu_setup)
def vq_silu_op(z: Tensor) -> Tensor:
    """``silu(z)`` for ``z`` ``[A, M, E]`` contiguous (PyTorch's vectorised kernel); the backward reads a strided
    incoming gradient in place (:func:`vq_silu_bwd_op`)."""
    return torch.nn.functional.silu(z)


def triton_vq_silu(z: Tensor) -> Tensor:
    """``silu(z)`` for ``z [A, ..., E]`` (``A`` the first dimension); the gradient by :func:`vq_silu_bwd_kernel`."""
    A, E = z.shape[0], z.shape[-1]
    return vq_silu_op(z.contiguous().view(A, -1, E)).view(z.shape)
