"""Host side of the fused gated linear unit activation: launchers, the ``lintime::glu_fwd`` / ``lintime::glu_bwd``
custom ops (traced by ``torch.compile``; eager calls skip the dispatcher, :mod:`lintime.ops.custom_op`) and the
backend entry :func:`triton_glu`.

Memory traffic is the minimum: the forward reads ``h [N, 2E]`` (or ``u`` and ``v``) once and writes ``y [N, E]``;
the backward reads them and ``dy`` once and writes ``dh [N, 2E]`` (the split's gradient is that one tensor, no
concatenation) or ``du`` and ``dv``.  ``lintime::gated_fwd`` / ``gated_bwd`` are the two-tensor form.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lintime.ops.custom_op import grad_as, launcher_op
from lintime.ops.glu.triton.kernels import glu_bwd_kernel, glu_fwd_kernel
from lintime.ops.kernel_launch import cdiv, check_device, interpreting

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = {"silu": 0, "gelu": 1}


@dataclasses.dataclass(frozen=True)
class GLULaunch:
    """Launch configuration of the GLU kernels: ``bn x be`` tiles.  Long contiguous row segments of a bandwidth-bound
    pass (the heads kernel's measured tile): fwd+bwd 0.52 ms at ``[32k, 2 x 2048]`` bf16 against the composite's
    1.07 (H200, 2026-11-27, ``lab/elementwise_ab.py``); other tiles not tried."""

    bn: int = 8
    be: int = 512
    warps: int = 4


def default_launch(device: torch.device) -> GLULaunch:
    """The GPU's :class:`GLULaunch`; under the interpreter 16 x 16 tiles so small test shapes cross several tiles."""
    if device.type == "cpu" and interpreting():
        return GLULaunch(16, 16, 1)
    return GLULaunch()


def _grid(N: int, E: int, cfg: GLULaunch) -> tuple[int]:
    return (cdiv(N, cfg.bn) * cdiv(E, cfg.be),)


def _rows(x: Tensor) -> Tensor:
    """``x [..., E]`` as ``[N, E]`` rows with unit column stride (a view where one exists)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 or x.shape[0] == 0 else x.contiguous()


def _launch_fwd(u: Tensor, v: Tensor, y: Tensor, act: int) -> None:
    N, E = u.shape
    if N and E:
        cfg = default_launch(u.device)
        glu_fwd_kernel[_grid(N, E, cfg)](u, v, y, u.stride(0), v.stride(0), y.stride(0), N, E, ACT=act, BN=cfg.bn,
                                         BE=cfg.be, num_warps=cfg.warps)


def _launch_bwd(dy: Tensor, u: Tensor, v: Tensor, du: Tensor, dv: Tensor, act: int) -> None:
    N, E = u.shape
    if N and E:
        cfg = default_launch(u.device)
        glu_bwd_kernel[_grid(N, E, cfg)](dy, u, v, du, dv, dy.stride(0), u.stride(0), v.stride(0), du.stride(0),
                                         dv.stride(0), N, E, ACT=act, BN=cfg.bn, BE=cfg.be, num_warps=cfg.warps)


# ---------------------------------------------------------------- glu_activation: h = [u, v], one tensor
@launcher_op("glu_bwd", fake=lambda dy, h, act: torch.empty_like(h))
def glu_bwd(dy: Tensor, h: Tensor, act: int) -> Tensor:
    """``dh [N, 2E]`` from ``dy [N, E]`` and ``h``."""
    dy, h = _rows(dy), h.contiguous()
    E = h.shape[1] // 2
    dh = torch.empty_like(h)
    _launch_bwd(dy, h[:, :E], h[:, E:], dh[:, :E], dh[:, E:], act)
    return dh


def _setup(ctx, inputs, output):
    h, act = inputs
    ctx.save_for_backward(h)
    ctx.act = act


def _backward(ctx, dy):
    (h,) = ctx.saved_tensors
    if dy is None:
        return None, None
    return glu_bwd.for_ctx(ctx)(grad_as(dy, h.dtype), h, ctx.act), None


@launcher_op("glu_fwd", fake=lambda h, act: h.new_empty(h.shape[0], h.shape[1] // 2), backward=_backward,
             setup_context=_setup)
def glu_fwd(h: Tensor, act: int) -> Tensor:
    """``y [N, E] = act(h[:, :E]) * h[:, E:]``."""
    h = h.contiguous()
    E = h.shape[1] // 2
    y = h.new_empty(h.shape[0], E)
    _launch_fwd(h[:, :E], h[:, E:], y, act)
    return y


# ---------------------------------------------------------------- gated_activation: u and v, two tensors
def _gated_bwd_fake(dy, u, v, act):
    return u.new_empty(u.shape), v.new_empty(v.shape)


@launcher_op("gated_bwd", fake=_gated_bwd_fake)
def gated_bwd(dy: Tensor, u: Tensor, v: Tensor, act: int) -> tuple[Tensor, Tensor]:
    """``(du, dv)`` (``u``'s / ``v``'s shape and dtype, contiguous) from ``dy``."""
    du, dv = torch.empty(u.shape, dtype=u.dtype, device=u.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)
    _launch_bwd(_rows(dy), _rows(u), _rows(v), du.view(-1, u.shape[-1]), dv.view(-1, v.shape[-1]), act)
    return du, dv


def _gated_setup(ctx, inputs, output):
    u, v, act = inputs
    ctx.save_for_backward(u, v)
    ctx.act = act


def _gated_backward(ctx, dy):
    u, v = ctx.saved_tensors
    if dy is None:
        return None, None, None
    du, dv = gated_bwd.for_ctx(ctx)(grad_as(dy, torch.promote_types(u.dtype, v.dtype)), u, v, ctx.act)
    return du, dv, None


def _gated_fwd_fake(u, v, act):
    return u.new_empty(u.shape, dtype=torch.promote_types(u.dtype, v.dtype))


@launcher_op("gated_fwd", fake=_gated_fwd_fake, backward=_gated_backward, setup_context=_gated_setup)
def gated_fwd(u: Tensor, v: Tensor, act: int) -> Tensor:
    """``y = act(u) * v`` (``[..., E]``, contiguous) in the promoted dtype of ``u`` and ``v`` (rows of any stride)."""
    y = torch.empty(u.shape, dtype=torch.promote_types(u.dtype, v.dtype), device=u.device)
    _launch_fwd(_rows(u), _rows(v), y.view(-1, u.shape[-1]), act)
    return y


def triton_glu(h: Tensor, *, activation: str = "silu") -> Tensor:
    """Fused GLU activation: same arguments and result as :func:`lintime.ops.glu.naive.naive_glu` (fp16 / bf16 /
    fp32 ``h``, computed in fp32 and rounded once)."""
    check_device("glu", h)
    W = h.shape[-1]
    y = glu_fwd(h.reshape(-1, W), ACTIVATIONS[activation])
    return y.view(*h.shape[:-1], W // 2)


def triton_gated(u: Tensor, v: Tensor, *, activation: str = "silu") -> Tensor:
    """Fused gate: same arguments and result as :func:`lintime.ops.glu.naive.naive_gated` (fp16 / bf16 / fp32 ``u``
    and ``v`` of one shape, row-strided views welcome; computed in fp32 and rounded once)."""
    check_device("gated_activation", u)
    if v.device != u.device:
        raise ValueError(f"gated_activation: u and v must be on one device, got {u.device} and {v.device}")
    return gated_fwd(u, v, ACTIVATIONS[activation])
