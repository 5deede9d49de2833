"""Host side of the fused gated linear unit activation: launchers, the ``lintime::glu_fwd`` / ``lintime::glu_bwd``
custom ops (traced by ``torch.compile``; eager calls skip the dispatcher, :mod:`lintime.ops.utils.launching`) and the
backend entry :func:`triton_glu`.

Memory traffic is the minimum: the forward reads ``h [N, 2E]`` (or ``u`` and ``v``) once and writes ``y [N, E]``;
the backward reads them and ``dy`` once and writes ``dh [N, 2E]`` (the split's gradient is that one tensor, no
concatenation) or ``du`` and ``dv``.  ``lintime::gated_fwd`` / ``gated_bwd`` are the two-tensor form, with an
optional bias ``b [E]`` added to ``u`` before the activation: its gradient, the column sums of ``du``, comes out of
the same backward pass as ``cdiv(N, bn rb)`` fp32 partial rows (``rb`` row tiles per program, :mod:`.kernels`), folded
by :func:`lintime.ops.fold.fold_rows` (one launch, fixed order: deterministic).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lintime.modules.glu.triton.kernels import glu_bwd_kernel, glu_fwd_kernel
from lintime.modules.glu.triton.launch import GLULaunch, default_launch
from lintime.ops.fold import fold_rows
from lintime.ops.utils.launching import cdiv, check_device, empty_f32, grad_as, launcher_op

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = {"silu": 0, "gelu": 1}


def _grid(N: int, E: int, cfg: GLULaunch) -> tuple[int]:
    return (cdiv(N, cfg.bn) * cdiv(E, cfg.be),)


def _rows(x: Tensor) -> Tensor:
    """``x [..., E]`` as ``[N, E]`` rows with unit column stride (a view where one exists)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 or x.shape[0] == 0 else x.contiguous()


def _launch_fwd(u: Tensor, v: Tensor, y: Tensor, act: int, bias: Tensor | None = None) -> None:
    """``y = act(u + bias) * v`` over ``[N, E]`` rows (``bias``: ``None`` or a contiguous ``[E]``)."""
    N, E = u.shape
    if N and E:
        cfg = default_launch(u.device)
        glu_fwd_kernel[_grid(N, E, cfg)](u, v, y, u if bias is None else bias, u.stride(0), v.stride(0), y.stride(0),
                                         N, E, ACT=act, HAS_BIAS=bias is not None, BN=cfg.bn, BE=cfg.be,
                                         num_warps=cfg.warps)


def _launch_bwd(dy: Tensor, u: Tensor, v: Tensor, du: Tensor, dv: Tensor, act: int,
                bias: Tensor | None = None) -> Tensor | None:
    """``du``, ``dv`` into the given rows; with ``bias`` (a contiguous ``[E]``) returns ``dbias``, the column sums of
    the fp32 ``du`` (fp32 ``[E]``)."""
    N, E = u.shape
    cfg = default_launch(u.device)
    strides = (dy.stride(0), u.stride(0), v.stride(0), du.stride(0), dv.stride(0))
    if bias is None:
        if N and E:
            glu_bwd_kernel[_grid(N, E, cfg)](dy, u, v, du, dv, u, du, *strides, N, E, ACT=act, HAS_BIAS=False,
                                             BN=cfg.bn, BE=cfg.be, RB=1, num_warps=cfg.warps)
        return None
    P = cdiv(N, cfg.bn * cfg.rb)
    part = torch.empty(P, E, dtype=torch.float32, device=u.device)
    if N and E:
        glu_bwd_kernel[(P * cdiv(E, cfg.be),)](dy, u, v, du, dv, bias, part, *strides, N, E, ACT=act, HAS_BIAS=True,
                                               BN=cfg.bn, BE=cfg.be, RB=cfg.rb, num_warps=cfg.warps)
    return fold_rows([part])[0]  # zeros for N = 0


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
def _gated_bwd_fake(dy, u, v, act, bias=None):
    return u.new_empty(u.shape), v.new_empty(v.shape), u.new_empty(0 if bias is None else u.shape[-1],
                                                                    dtype=torch.float32)


@launcher_op("gated_bwd", fake=_gated_bwd_fake)
def gated_bwd(dy: Tensor, u: Tensor, v: Tensor, act: int, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(du, dv, dbias)`` from ``dy``: ``du``, ``dv`` of ``u``'s / ``v``'s shape and dtype (contiguous); ``dbias``
    the sum of ``du`` over all rows (the gradient of ``u + bias``) from its unrounded fp32 values, fp32 ``[E]``, or
    an empty fp32 tensor without ``bias``."""
    du, dv = torch.empty(u.shape, dtype=u.dtype, device=u.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)
    E = u.shape[-1]
    dbias = _launch_bwd(_rows(dy), _rows(u), _rows(v), du.view(-1, E), dv.view(-1, E), act,
                        None if bias is None else bias.contiguous())
    return du, dv, empty_f32(u) if dbias is None else dbias


def _gated_setup(ctx, inputs, output):
    u, v, act, bias = inputs
    ctx.save_for_backward(u, v, bias)
    ctx.act = act


def _gated_backward(ctx, dy):
    u, v, bias = ctx.saved_tensors
    if dy is None:
        return None, None, None, None
    du, dv, dbias = gated_bwd.for_ctx(ctx)(grad_as(dy, torch.promote_types(u.dtype, v.dtype)), u, v, ctx.act, bias)
    return du, dv, None, (dbias.to(bias.dtype) if ctx.needs_input_grad[3] else None)


def _gated_fwd_fake(u, v, act, bias):
    return u.new_empty(u.shape, dtype=torch.promote_types(u.dtype, v.dtype))


@launcher_op("gated_fwd", fake=_gated_fwd_fake, backward=_gated_backward, setup_context=_gated_setup)
def gated_fwd(u: Tensor, v: Tensor, act: int, bias: Tensor | None) -> Tensor:
    """``y = act(u + bias) * v`` (``[..., E]``, contiguous) in the promoted dtype of ``u`` and ``v`` (rows of any
    stride; ``bias``: ``None`` or ``[E]`` of any floating dtype, rounded to ``u``'s)."""
    y = torch.empty(u.shape, dtype=torch.promote_types(u.dtype, v.dtype), device=u.device)
    _launch_fwd(_rows(u), _rows(v), y.view(-1, u.shape[-1]), act, None if bias is None else bias.contiguous())
    return y


def triton_glu(h: Tensor, *, activation: str = "silu") -> Tensor:
    """Fused GLU activation: same arguments and result as :func:`lintime.modules.glu.naive.naive_glu` (fp16 / bf16 /
    fp32 ``h``, computed in fp32 and rounded once)."""
    check_device("glu", h)
    W = h.shape[-1]
    y = glu_fwd(h.reshape(-1, W), ACTIVATIONS[activation])
    return y.view(*h.shape[:-1], W // 2)


def triton_gated(u: Tensor, v: Tensor, *, activation: str = "silu", bias: Tensor | None = None) -> Tensor:
    """Fused gate: same arguments and result as :func:`lintime.modules.glu.naive.naive_gated` (fp16 / bf16 / fp32 ``u``
    and ``v`` of one shape, row-strided views welcome, ``bias [E]`` or ``None``; computed in fp32 and rounded once;
    ``bias``'s gradient summed in fp32 in the backward pass)."""
    check_device("gated_activation", u)
    for name, x in (("v", v), ("bias", bias)):
        if x is not None and x.device != u.device:
            raise ValueError(f"gated_activation: u and {name} must be on one device, got {u.device} and {x.device}")
    return gated_fwd(u, v, ACTIVATIONS[activation], bias)
