"""Host side of the fused normalisation: launchers, the ``lintime::normalize_*`` custom ops (traced
by ``torch.compile``; eager calls skip the dispatcher, :mod:`lintime.ops.custom_op`) and the backend
entry :func:`triton_normalize`."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lintime.ops.custom_op import empty_f32, grad_as, launcher_op, none_if_empty
from lintime.ops.kernel_launch import check_device, interpreting, next_pow2, sm_count
from lintime.ops.norm.triton.kernels import norm_bwd_kernel, norm_fwd_kernel

_OP = "normalize"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KIND = {"layernorm": 0, "rmsnorm": 1, "scalenorm": 1}


@dataclasses.dataclass(frozen=True)
class NormLaunch:
    """Launch configuration of the norm kernels."""

    # Persistent programs per SM: enough rows in flight to hide the row loads (arithmetic; the
    # kernels are bandwidth-bound at one read and one write per row), not yet tuned on a GPU.
    programs_per_sm: int = 8
    max_bd: int = 16384  # the widest row held in registers (D up to 16384)


LAUNCH = NormLaunch()


def _programs(x: Tensor, N: int) -> int:
    return max(1, min(N, 4 if interpreting() else sm_count(x.device) * LAUNCH.programs_per_sm))


def _warps(BD: int) -> int:
    return min(16, max(1, BD // 256))


def _fwd(x: Tensor, weight: Tensor, bias: Tensor, kind: str, eps: float,
         out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    N, D = x.shape
    BD = next_pow2(D)
    y = torch.empty((N, D), device=x.device, dtype=out_dtype)
    mean = torch.empty((N,) if kind == "layernorm" else (0,), device=x.device, dtype=torch.float32)
    rstd = torch.empty((N,), device=x.device, dtype=torch.float32)
    if N:
        norm_fwd_kernel[(_programs(x, N),)](
            x, weight, bias, y, mean, rstd, x.stride(0), y.stride(0), N, D, eps,
            KIND=_KIND[kind], HAS_W=weight.numel() > 0, W_SCALAR=kind == "scalenorm" and weight.numel() > 0,
            HAS_B=bias.numel() > 0, BD=BD, num_warps=_warps(BD),
        )
    return y, mean, rstd


def _bwd_fake(dy, x, weight, bias, mean, rstd, kind):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


@launcher_op("normalize_bwd", fake=_bwd_fake)
def normalize_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
                  kind: str) -> tuple[Tensor, Tensor, Tensor]:
    N, D = x.shape
    BD = next_pow2(D)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = torch.empty_like(x)
    G = _programs(x, N)
    has_w, has_b = weight.numel() > 0, bias.numel() > 0
    dw_part = torch.empty((G, BD) if has_w else (0,), device=x.device, dtype=torch.float32)
    db_part = torch.empty((G, BD) if has_b else (0,), device=x.device, dtype=torch.float32)
    if N:
        norm_bwd_kernel[(G,)](
            x, weight, dy, dx, mean, rstd, dw_part, db_part, x.stride(0), dy.stride(0), dx.stride(0), N, D,
            KIND=_KIND[kind], HAS_W=has_w, W_SCALAR=kind == "scalenorm" and has_w, HAS_B=has_b, BD=BD,
            num_warps=_warps(BD),
        )
    if has_w:
        dw = dw_part.sum(0)[:D] if N else torch.zeros(D, device=x.device)
        dw = (dw.sum() if kind == "scalenorm" else dw).to(weight.dtype)
    else:
        dw = torch.empty_like(weight)
    db = (db_part.sum(0)[:D] if N else torch.zeros(D, device=x.device)).to(bias.dtype) if has_b \
        else torch.empty_like(bias)
    return dx, dw, db


def _fwd_fake(x, weight, bias, kind, eps, out_dtype):
    N = x.shape[0]
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty((N,) if kind == "layernorm" else (0,), dtype=torch.float32),
            x.new_empty((N,), dtype=torch.float32))


def _setup(ctx, inputs, output):
    x, weight, bias, kind, _, out_dtype = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.kind, ctx.out_dtype = kind, out_dtype


def _backward(ctx, dy, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None
    dx, dw, db = normalize_bwd.for_ctx(ctx)(grad_as(dy, ctx.out_dtype), x, weight, bias, mean, rstd, ctx.kind)
    return (dx, none_if_empty(dw) if ctx.needs_input_grad[1] else None,
            none_if_empty(db) if ctx.needs_input_grad[2] else None, None, None, None)


@launcher_op("normalize_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup, outputs=1)
def normalize_fwd(x: Tensor, weight: Tensor, bias: Tensor, kind: str, eps: float,
                  out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return _fwd(x, weight, bias, kind, eps, out_dtype)


def triton_normalize(x, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.ops.norm.normalize` on ``x [N, D]`` (fp16, bf16 or
    fp32 in and out, ``D`` up to :attr:`NormLaunch.max_bd`)."""
    check_device(_OP, x)
    if x.dtype not in DTYPES or out_dtype not in DTYPES:
        raise TypeError(f"{_OP}: backend 'triton' takes fp16, bf16 or fp32, got {x.dtype} -> {out_dtype}")
    if x.shape[-1] > LAUNCH.max_bd:
        raise ValueError(f"{_OP}: backend 'triton' supports D <= {LAUNCH.max_bd}, got {x.shape[-1]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = empty_f32(x) if weight is None else weight
    b = empty_f32(x) if bias is None else bias
    return normalize_fwd(x, w, b, kind, eps, out_dtype)[0]
