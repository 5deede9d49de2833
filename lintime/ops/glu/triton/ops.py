"""Host side of the fused gated linear unit activation: launchers, the ``lintime::glu_fwd`` / ``lintime::glu_bwd``
custom ops (traced by ``torch.compile``; eager calls skip the dispatcher, :mod:`lintime.ops.custom_op`) and the
backend entry :func:`triton_glu`.

Memory traffic is the minimum: the forward reads ``h [N, 2E]`` once and writes ``y [N, E]``; the backward reads
``h`` and ``dy`` once and writes ``dh [N, 2E]`` (the split's gradient is that one tensor, no concatenation).
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


def _fwd_impl(h: Tensor, act: int) -> Tensor:
    h = h.contiguous()
    N, E = h.shape[0], h.shape[1] // 2
    y = h.new_empty(N, E)
    if N and E:
        cfg = default_launch(h.device)
        glu_fwd_kernel[_grid(N, E, cfg)](h, y, N, E, ACT=act, BN=cfg.bn, BE=cfg.be, num_warps=cfg.warps)
    return y


def _bwd_impl(dy: Tensor, h: Tensor, act: int) -> Tensor:
    dy, h = dy.contiguous(), h.contiguous()
    N, E = h.shape[0], h.shape[1] // 2
    dh = torch.empty_like(h)
    if N and E:
        cfg = default_launch(h.device)
        glu_bwd_kernel[_grid(N, E, cfg)](dy, h, dh, N, E, ACT=act, BN=cfg.bn, BE=cfg.be, num_warps=cfg.warps)
    return dh


@launcher_op("glu_bwd", fake=lambda dy, h, act: torch.empty_like(h))
def glu_bwd(dy: Tensor, h: Tensor, act: int) -> Tensor:
    """``dh [N, 2E]`` from ``dy [N, E]`` and ``h``."""
    return _bwd_impl(dy, h, act)


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
    return _fwd_impl(h, act)


def triton_glu(h: Tensor, *, activation: str = "silu") -> Tensor:
    """Fused GLU activation: same arguments and result as :func:`lintime.ops.glu.naive.naive_glu` (fp16 / bf16 /
    fp32 ``h``, computed in fp32 and rounded once)."""
    check_device("glu", h)
    W = h.shape[-1]
    y = glu_fwd(h.reshape(-1, W), ACTIVATIONS[activation])
    return y.view(*h.shape[:-1], W // 2)
