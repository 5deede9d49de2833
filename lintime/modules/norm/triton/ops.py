"""Host side of the fused normalisation: launchers, the ``lintime::normalize_*``, ``lintime::add_normalize_*`` and
``lintime::gated_normalize_*`` custom ops (traced by ``torch.compile``; eager calls skip the dispatcher,
:mod:`lintime.ops.utils.launching`) and the backend entries :func:`triton_normalize`, :func:`triton_add_normalize` and
:func:`triton_gated_normalize`."""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from lintime.modules.norm.triton.kernels import norm_bwd_kernel, norm_fwd_kernel
from lintime.modules.norm.triton.launch import default_launch
from lintime.ops.fold import fold_rows
from lintime.ops.utils.launching import (
    cdiv,
    check_device,
    empty_f32,
    grad_as,
    interpreting,
    launcher_op,
    next_pow2,
    none_if_empty,
    sm_count,
)

_OP = "normalize"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KIND = {"layernorm": 0, "rmsnorm": 1, "scalenorm": 1}


def tiling(N: int, D: int, backward: bool = False) -> tuple[int, int, int, int]:
    """``(BD, BM, num_warps, tiles)`` of a forward (or ``backward``) call on ``N`` rows of ``D`` features under
    :func:`default_launch`; ``BM`` is at most ``N`` rounded up to a power of two (a short call masks no more rows than
    that)."""
    launch = default_launch()
    BD = next_pow2(D)
    if launch.rows_per_tile:
        BM = launch.rows_per_tile
    elif backward and BD < launch.backward_tiles_from:
        BM = 1
    else:
        BM = max(1, launch.tile_elems // BD)
    BM = min(BM, next_pow2(N))
    per_warp = launch.row_elems_per_warp if BM == 1 else launch.elems_per_warp
    warps = min(launch.max_warps, max(1, BM * BD // per_warp))
    return BD, BM, warps, cdiv(N, BM)


def max_programs(x: Tensor, warps: int) -> int:
    """The most persistent programs of ``warps`` warps a launch on ``x``'s device takes: 4 under the interpreter
    (small tests walk several tiles per program), else SMs x :attr:`NormLaunch.programs_per_sm` or, without it, SMs x
    the programs whose threads one SM holds."""
    if interpreting():
        return 4
    per_sm = default_launch().programs_per_sm
    if per_sm:
        return sm_count(x.device) * per_sm
    return sm_count(x.device) * max(1, _threads_per_sm(x.device) // (32 * warps))


def _programs(kernel, args: tuple, meta: dict, x: Tensor, tiles: int) -> int:
    """Persistent programs of a launch ``kernel[grid](*args, **meta)`` of ``tiles`` tiles (``meta`` holds
    ``num_warps``): :func:`max_programs`, or, where :attr:`NormLaunch.programs_per_sm` is 0 on CUDA, SMs x
    the programs of the compiled kernel one SM holds at once (:func:`_resident`); never more than ``tiles``."""
    if interpreting() or default_launch().programs_per_sm:
        return max(1, min(tiles, max_programs(x, meta["num_warps"])))
    return max(1, min(tiles, sm_count(x.device) * _resident(kernel, args, meta, x.device)))


_RESIDENT: dict[tuple, int] = {}  # (kernel, device index, tensor dtypes, constexprs and warps) -> programs per SM


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _threads_per_sm(device: torch.device) -> int:
    return _max_threads(_device_index(device))


@functools.cache
def _max_threads(index: int) -> int:
    return torch.cuda.get_device_properties(index).max_threads_per_multi_processor


def _resident(kernel, args: tuple, meta: dict, device: torch.device) -> int:
    """Programs of ``kernel`` compiled for ``args`` / ``meta`` that one SM holds at once: the least of its register
    file over the registers of a program (allocated per warp in 256-register units), its threads over a program's,
    and its shared memory over a program's (the occupancy rule of Triton's fused-softmax tutorial).  Compiled by
    ``warmup`` on the first call of a specialisation (the launch that follows reuses the compile), then cached."""
    index = _device_index(device)
    key = (kernel, index, *(a.dtype for a in args if isinstance(a, Tensor)), *meta.values())
    fit = _RESIDENT.get(key)
    if fit is None:
        compiled = kernel.warmup(*args, grid=(1,), **meta)
        compiled._init_handles()  # loads the binary: fills n_regs
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        warps = meta["num_warps"]
        warp_regs = -(-compiled.n_regs * 32 // 256) * 256
        fit = min(props["max_num_regs"] // warp_regs // warps, _threads_per_sm(device) // (32 * warps),
                  props["max_shared_mem"] // max(1, compiled.metadata.shared))
        fit = _RESIDENT[key] = max(1, fit)
    return fit


def _flags(kind: str, weight: Tensor, bias: Tensor) -> dict:
    has_w = weight.numel() > 0
    return dict(KIND=_KIND[kind], HAS_W=has_w, W_SCALAR=kind == "scalenorm" and has_w, HAS_B=bias.numel() > 0)


def _fwd(x: Tensor, r: Tensor | None, weight: Tensor, bias: Tensor, kind: str, eps: float,
         out_dtype: torch.dtype, z: Tensor | None = None,
         rb: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(s, y, mean, rstd)``: ``s = x + r`` (an empty tensor without ``r``; ``x + (r + rb)`` with the branch's bias
    ``rb``) and ``y = norm(s)`` (times ``silu(z)`` with a gate ``z``)."""
    N, D = x.shape
    BD, BM, warps, tiles = tiling(N, D)
    s = x.new_empty((N, D), dtype=torch.promote_types(x.dtype, r.dtype)) if r is not None else empty_f32(x)
    y = torch.empty((N, D), device=x.device, dtype=out_dtype)
    mean = torch.empty((N,) if kind == "layernorm" else (0,), device=x.device, dtype=torch.float32)
    rstd = torch.empty((N,), device=x.device, dtype=torch.float32)
    if N:
        rr, ss = (x, x) if r is None else (r, s)  # unread without HAS_R
        zz = x if z is None else z  # unread without HAS_GATE
        rbb = x if rb is None else rb  # unread without HAS_RB
        args = (x, rr, rbb, zz, weight, bias, ss, y, mean, rstd, x.stride(0), rr.stride(0), zz.stride(0),
                ss.stride(0), y.stride(0), N, D, eps)
        meta = dict(**_flags(kind, weight, bias), HAS_R=r is not None, HAS_RB=rb is not None, HAS_GATE=z is not None,
                    BM=BM, BD=BD, num_warps=warps)
        norm_fwd_kernel[(_programs(norm_fwd_kernel, args, meta, x, tiles),)](*args, **meta)
    return s, y, mean, rstd


def _bwd(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
         kind: str, dx_dtype: torch.dtype, dr_dtype: torch.dtype | None, z: Tensor | None = None,
         rb: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dr, dw, db, dz, drb)``: ``dx = ds + norm'(dy)`` in ``dx_dtype``, the same values in ``dr_dtype`` as
    ``dr`` (an empty tensor when ``dr_dtype`` is ``None``), the gain / bias gradients (empty when absent), with a
    gate ``z`` its gradient ``dz`` (``norm'`` then takes ``dy * silu(z)``; else ``dz`` is empty) and, with a branch
    bias ``rb``, its gradient ``drb``: the column sums of ``dx`` in fp32 before its rounding, in ``rb``'s dtype
    (else empty)."""
    N, D = x.shape
    BD, BM, warps, tiles = tiling(N, D, backward=True)
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    if ds is not None:
        ds = ds if ds.stride(-1) == 1 else ds.contiguous()
    dx = torch.empty((N, D), device=x.device, dtype=dx_dtype)
    dr = empty_f32(x) if dr_dtype is None else torch.empty((N, D), device=x.device, dtype=dr_dtype)
    dz = empty_f32(x) if z is None else torch.empty((N, D), device=x.device, dtype=z.dtype)
    flags = _flags(kind, weight, bias)
    has_w, has_b, has_rb = flags["HAS_W"], flags["HAS_B"], rb is not None
    dss, drr = (dx if ds is None else ds), (dx if dr_dtype is None else dr)  # unread / unwritten without the flag
    zz, dzz = (x, dx) if z is None else (z, dz)

    def args(dw_part, db_part, drb_part):
        return (x, zz, weight, bias, dy, dss, dx, drr, dzz, mean, rstd, dw_part, db_part, drb_part, x.stride(0),
                zz.stride(0), dy.stride(0), dss.stride(0), dx.stride(0), drr.stride(0), dzz.stride(0), N, D)

    meta = dict(**flags, HAS_DS=ds is not None, HAS_DR=dr_dtype is not None, HAS_DRB=has_rb, HAS_GATE=z is not None,
                BM=BM, BD=BD, num_warps=warps)
    # the partials' rows depend on the grid: the fp32 `rstd` stands in for them while the grid is chosen
    G = _programs(norm_bwd_kernel, args(rstd, rstd, rstd), meta, x, tiles) if N else 1
    parts = [torch.empty((G, BD) if need else (0,), device=x.device, dtype=torch.float32)
             for need in (has_w, has_b, has_rb)]  # dw, db, drb
    if N:
        norm_bwd_kernel[(G,)](*args(*parts), **meta)
    # the programs' partial rows folded in one launch (fixed order: deterministic)
    live = [p for p, need in zip(parts, (has_w, has_b, has_rb)) if need]
    sums = iter(fold_rows(live) if N and live else [])

    def column_sums(need: bool, like: Tensor) -> Tensor:
        if not need:
            return torch.empty_like(like)
        return next(sums)[:D] if N else torch.zeros(D, device=x.device)

    dw = column_sums(has_w, weight)
    if has_w:
        dw = (dw.sum() if kind == "scalenorm" else dw).to(weight.dtype)
    db = column_sums(has_b, bias).to(bias.dtype)
    drb = empty_f32(x) if rb is None else column_sums(True, rb).to(rb.dtype)
    return dx, dr, dw, db, dz, drb


def _params(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The gain and bias as the custom ops take them: an absent one is an empty fp32 tensor."""
    return (empty_f32(x) if weight is None else weight), (empty_f32(x) if bias is None else bias)


def _check(x: Tensor, out_dtype: torch.dtype, op: str) -> Tensor:
    check_device(op, x)
    if x.dtype not in DTYPES or out_dtype not in DTYPES:
        raise TypeError(f"{op}: backend 'triton' takes fp16, bf16 or fp32, got {x.dtype} -> {out_dtype}")
    max_bd = default_launch().max_bd
    if x.shape[-1] > max_bd:
        raise ValueError(f"{op}: backend 'triton' supports D <= {max_bd}, got {x.shape[-1]}")
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------- normalize


def _bwd_fake(dy, x, weight, bias, mean, rstd, kind):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


@launcher_op("normalize_bwd", fake=_bwd_fake)
def normalize_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
                  kind: str) -> tuple[Tensor, Tensor, Tensor]:
    dx, _, dw, db, _, _ = _bwd(dy, None, x, weight, bias, mean, rstd, kind, x.dtype, None)
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
    return _fwd(x, None, weight, bias, kind, eps, out_dtype)[1:]


def triton_normalize(x, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.normalize` on ``x [N, D]`` (fp16, bf16 or
    fp32 in and out, ``D`` up to :attr:`NormLaunch.max_bd`)."""
    x = _check(x, out_dtype, _OP)
    w, b = _params(x, weight, bias)
    return normalize_fwd(x, w, b, kind, eps, out_dtype)[0]


# ------------------------------------------------------------------------------------------ add_normalize


def _add_bwd_fake(dy, ds, s, weight, bias, rbias, mean, rstd, kind, x_dtype, r_dtype):
    dr = s.new_empty(s.shape, dtype=r_dtype) if r_dtype != x_dtype else s.new_empty(0, dtype=torch.float32)
    return (s.new_empty(s.shape, dtype=x_dtype), dr, torch.empty_like(weight), torch.empty_like(bias),
            torch.empty_like(rbias))


@launcher_op("add_normalize_bwd", fake=_add_bwd_fake)
def add_normalize_bwd(dy: Tensor, ds: Tensor, s: Tensor, weight: Tensor, bias: Tensor, rbias: Tensor, mean: Tensor,
                      rstd: Tensor, kind: str, x_dtype: torch.dtype,
                      r_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``ds`` empty: no gradient reached the sum itself.  ``dr`` is empty when ``r_dtype == x_dtype`` (the
    caller uses ``dx`` for both: an op's outputs may not alias).  ``rbias`` (the branch's bias, read for its
    dtype) empty: none, and its gradient is empty too."""
    dr_dtype = None if r_dtype == x_dtype else r_dtype
    dx, dr, dw, db, _, drb = _bwd(dy, none_if_empty(ds), s, weight, bias, mean, rstd, kind, x_dtype, dr_dtype,
                                  rb=none_if_empty(rbias))
    return dx, dr, dw, db, drb


def _add_fwd_fake(x, r, weight, bias, rbias, kind, eps, out_dtype):
    N = x.shape[0]
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, r.dtype))
    mean = x.new_empty((N,) if kind == "layernorm" else (0,), dtype=torch.float32)
    return s, x.new_empty(x.shape, dtype=out_dtype), mean, x.new_empty((N,), dtype=torch.float32)


def _add_setup(ctx, inputs, output):
    x, r, weight, bias, rbias, kind, _, out_dtype = inputs
    s, _, mean, rstd = output
    ctx.save_for_backward(s, weight, bias, rbias, mean, rstd)
    ctx.kind, ctx.out_dtype, ctx.x_dtype, ctx.r_dtype = kind, out_dtype, x.dtype, r.dtype


def _add_backward(ctx, ds, dy, *_):
    s, weight, bias, rbias, mean, rstd = ctx.saved_tensors
    want_rb = ctx.needs_input_grad[4] and rbias.numel() > 0
    if dy is None:  # only the sum was used: the gradient passes straight to x and r (and its column sums to rbias)
        if ds is None:
            return (None,) * 8
        drb = ds.sum(0, dtype=torch.float32).to(rbias.dtype) if want_rb else None
        return ds.to(ctx.x_dtype), ds.to(ctx.r_dtype), None, None, drb, None, None, None
    ds = empty_f32(s) if ds is None else grad_as(ds, s.dtype)
    dx, dr, dw, db, drb = add_normalize_bwd.for_ctx(ctx)(grad_as(dy, ctx.out_dtype), ds, s, weight, bias, rbias,
                                                         mean, rstd, ctx.kind, ctx.x_dtype, ctx.r_dtype)
    return (dx, dx if ctx.r_dtype == ctx.x_dtype else dr, none_if_empty(dw) if ctx.needs_input_grad[2] else None,
            none_if_empty(db) if ctx.needs_input_grad[3] else None, drb if want_rb else None, None, None, None)


@launcher_op("add_normalize_fwd", fake=_add_fwd_fake, backward=_add_backward, setup_context=_add_setup, outputs=2)
def add_normalize_fwd(x: Tensor, r: Tensor, weight: Tensor, bias: Tensor, rbias: Tensor, kind: str, eps: float,
                      out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``rbias``: the branch's bias ``[D]`` (an empty tensor: none)."""
    return _fwd(x, r, weight, bias, kind, eps, out_dtype, rb=none_if_empty(rbias))


def triton_add_normalize(x, r, weight, bias, *, kind, eps, out_dtype, branch_bias=None):
    """Same arguments and results as :func:`lintime.modules.norm.add_normalize` on ``x, r [N, D]`` (fp16, bf16 or
    fp32 in and out and ``branch_bias``, ``D`` up to :attr:`NormLaunch.max_bd`)."""
    op = "add_normalize"
    x = _check(x, out_dtype, op)
    r = _check(r, out_dtype, op)
    if branch_bias is not None and branch_bias.dtype not in DTYPES:
        raise TypeError(f"{op}: backend 'triton' takes an fp16, bf16 or fp32 branch_bias, got {branch_bias.dtype}")
    w, b = _params(x, weight, bias)
    rb = empty_f32(x) if branch_bias is None else (branch_bias if branch_bias.stride(0) == 1 else
                                                   branch_bias.contiguous())
    return add_normalize_fwd(x, r, w, b, rb, kind, eps, out_dtype)


# ---------------------------------------------------------------------------------------- gated_normalize


def _gated_bwd_fake(dy, x, z, weight, bias, mean, rstd, kind):
    return torch.empty_like(x), torch.empty_like(z), torch.empty_like(weight), torch.empty_like(bias)


@launcher_op("gated_normalize_bwd", fake=_gated_bwd_fake)
def gated_normalize_bwd(dy: Tensor, x: Tensor, z: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
                        kind: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx, _, dw, db, dz, _ = _bwd(dy, None, x, weight, bias, mean, rstd, kind, x.dtype, None, z=z)
    return dx, dz, dw, db


def _gated_fwd_fake(x, z, weight, bias, kind, eps, out_dtype):
    return _fwd_fake(x, weight, bias, kind, eps, out_dtype)


def _gated_setup(ctx, inputs, output):
    x, z, weight, bias, kind, _, out_dtype = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, z, weight, bias, mean, rstd)
    ctx.kind, ctx.out_dtype = kind, out_dtype


def _gated_backward(ctx, dy, *_):
    x, z, weight, bias, mean, rstd = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None, None
    dx, dz, dw, db = gated_normalize_bwd.for_ctx(ctx)(grad_as(dy, ctx.out_dtype), x, z, weight, bias, mean, rstd,
                                                      ctx.kind)
    return (dx, dz, none_if_empty(dw) if ctx.needs_input_grad[2] else None,
            none_if_empty(db) if ctx.needs_input_grad[3] else None, None, None, None)


@launcher_op("gated_normalize_fwd", fake=_gated_fwd_fake, backward=_gated_backward, setup_context=_gated_setup,
             outputs=1)
def gated_normalize_fwd(x: Tensor, z: Tensor, weight: Tensor, bias: Tensor, kind: str, eps: float,
                        out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return _fwd(x, None, weight, bias, kind, eps, out_dtype, z=z)[1:]


def triton_gated_normalize(x, z, weight, bias, *, kind, eps, out_dtype):
    """Same arguments and result as :func:`lintime.modules.norm.gated_normalize` on ``x, z [N, D]`` (fp16, bf16 or
    fp32 in and out, ``D`` up to :attr:`NormLaunch.max_bd`)."""
    op = "gated_normalize"
    x = _check(x, out_dtype, op)
    z = _check(z, out_dtype, op)
    w, b = _params(x, weight, bias)
    return gated_normalize_fwd(x, z, w, b, kind, eps, out_dtype)[0]
