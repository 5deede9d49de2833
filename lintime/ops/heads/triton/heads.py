"""GAU / FLASH heads on one fused Triton kernel each way (see :mod:`.kernels`).

``lintime::gau_heads_fwd`` / ``lintime::gau_heads_bwd`` are ``torch.library`` custom ops (fake
tensors for ``torch.compile``) tied together by ``register_autograd``, made by
:func:`lintime.ops.custom_op.launcher_op`: eager calls take the same launchers without the op dispatch.  The public entry is
:func:`triton_gau_heads`, the ``"triton"`` backend of :func:`lintime.ops.gau_heads`.

Memory traffic is the minimum: the forward reads ``h`` once and writes ``u, v, heads``; the
backward reads ``h`` and the three output gradients once and writes ``dh`` once, plus the
``[cdiv(TT, bth), nh, s]`` fp32 partial sums of ``dgamma`` / ``dbeta`` (16 MB for 32k tokens,
``nh = 4``, ``bth = 8``) that two ``sum`` calls fold, in a fixed order (deterministic).  The
backward keeps only the inputs ``h``, ``gamma`` and ``positions`` (the activation is recomputed).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.heads.triton.kernels import (
    gau_heads_bwd_kernel,
    gau_heads_fwd_kernel,
)
from lintime.ops.custom_op import grad_as, launcher_op
from lintime.ops.kernel_launch import cdiv, check_device, interpreting, next_pow2
from lintime.ops.utils import rope_inv_freq


@dataclass(frozen=True)
class HeadsLaunch:
    """Launch configuration of the heads kernels.  Defaults: the GPU's, measured on an H200 (B * T = 32k, e = 2048,
    s = 128, nh = 4, bf16, 2026-11-22): forward 0.150 ms (3.85 TB/s; a clone of ``h`` 4.14), backward 0.319 ms."""

    bt: int = 8  # rows of a u / v tile: long contiguous row segments; 4 x 1024, 16 x 512, 32 x 128 no faster
    be: int = 512  # columns of a u / v tile
    bth: int = 8  # rows per heads program, which bound the backward: 16 / 32 rows gave 0.37 / 0.40 ms
    warps: int = 4  # per program; 2 or 8 warps no faster


def default_launch(device: torch.device) -> HeadsLaunch:
    """The GPU's :class:`HeadsLaunch`; under the interpreter 16 x 16 tiles and 16-row heads programs, so that small
    test shapes cross several row blocks and ``u`` / ``v`` tiles, with partial ones."""
    if device.type == "cpu" and interpreting():
        return HeadsLaunch(16, 16, 16, 1)
    return HeadsLaunch()


def _grid(TT, e, gating, cfg: HeadsLaunch):
    """Heads programs then tile programs (:mod:`.kernels`), and the number of heads programs."""
    ne = cdiv(e, cfg.be)
    nhb = cdiv(TT, cfg.bth)
    return (nhb + cdiv(TT, cfg.bt) * (2 * ne if gating else ne),), nhb


@functools.lru_cache(maxsize=32)
def _inv_freq(half: int, base: float, device: str) -> torch.Tensor:
    """The fp32 RoPE frequencies of :func:`lintime.ops.utils.rope` (cached per call shape), so the angles match."""
    return rope_inv_freq(half, base, torch.float32, device)


def _layout(h, gamma, s, rope_heads):
    B, T, W = h.shape
    hd = s // rope_heads // 2
    return B, T, W, B * T, gamma.shape[0], hd


def _fwd_impl(h, gamma, beta, positions, e, s, gating, rope_base, rope_heads, cfg: HeadsLaunch | None = None):
    """The forward launcher: ``(u, v, heads)``, ``u`` an empty tensor without gating."""
    cfg = cfg or default_launch(h.device)
    B, T, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    h, gamma, beta, positions = (x.contiguous() for x in (h, gamma, beta, positions))
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    v = h.new_empty(B, T, e)
    heads = h.new_empty(B, T, nh, s)
    if TT == 0:
        return u, v, heads
    grid, _ = _grid(TT, e, gating, cfg)
    gau_heads_fwd_kernel[grid](
        h, u if gating else v, v, heads, gamma, beta, positions, _inv_freq(hd, rope_base, str(h.device)),
        TT, e, W,
        S=s, NH=nh, HD=hd, GATING=gating, BT=cfg.bt, BE=cfg.be, BTH=cfg.bth, BH=next_pow2(s // 2),
        num_warps=cfg.warps,
    )
    return u, v, heads


def _bwd_impl(du, dv, dheads, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams,
              cfg: HeadsLaunch | None = None):
    """The backward launcher: ``dh`` (``h``'s dtype) and, when ``need_dparams``, ``dgamma`` and
    ``dbeta`` as fp32 ``[nh, s]`` (else empty tensors).  ``None`` gradients count as zero."""
    cfg = cfg or default_launch(h.device)
    _, _, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    du = du if (gating and du is not None and du.numel()) else None
    h, gamma, positions = (x.contiguous() for x in (h, gamma, positions))
    du, dv, dheads = (None if x is None else x.contiguous() for x in (du, dv, dheads))
    dh = torch.empty_like(h)
    need_part = need_dparams and dheads is not None and TT > 0
    grid, nhb = _grid(TT, e, gating, cfg)
    f32 = {"dtype": torch.float32, "device": h.device}
    part = torch.empty(2, nhb, nh, s, **f32) if need_part else torch.empty(1, **f32)
    if TT > 0:
        gau_heads_bwd_kernel[grid](
            h, du if du is not None else h, dv if dv is not None else h, dheads if dheads is not None else h,
            gamma, positions, _inv_freq(hd, rope_base, str(h.device)), dh, part[0], part[-1],
            TT, e, W,
            S=s, NH=nh, HD=hd, GATING=gating, HAS_DU=du is not None, HAS_DV=dv is not None,
            HAS_DHEADS=dheads is not None, NEED_DP=need_part,
            BT=cfg.bt, BE=cfg.be, BTH=cfg.bth, BH=next_pow2(s // 2), num_warps=cfg.warps,
        )
    # (separate tensors, not views of one: a custom op's outputs may not alias each other)
    if need_part:
        dgamma, dbeta = part[0].sum(0), part[1].sum(0)
    elif need_dparams:  # no gradient reaches the heads
        dgamma, dbeta = torch.zeros(nh, s, **f32), torch.zeros(nh, s, **f32)
    else:
        dgamma, dbeta = h.new_empty(0, dtype=torch.float32), h.new_empty(0, dtype=torch.float32)
    return dh, dgamma, dbeta


# ---------------------------------------------------------------------------------------------
# custom ops (torch.compile) and the eager Function


def _fwd_fake(h, gamma, beta, positions, e, s, gating, rope_base, rope_heads):
    B, T, _ = h.shape
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    return u, h.new_empty(B, T, e), h.new_empty(B, T, gamma.shape[0], s)


def _bwd_fake(du, dv, dheads, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams):
    shape = tuple(gamma.shape) if need_dparams else (0,)
    return (torch.empty_like(h), h.new_empty(shape, dtype=torch.float32), h.new_empty(shape, dtype=torch.float32))


@launcher_op("gau_heads_bwd", fake=_bwd_fake)
def gau_heads_bwd(
    du: torch.Tensor | None, dv: torch.Tensor | None, dheads: torch.Tensor | None,
    h: torch.Tensor, gamma: torch.Tensor, positions: torch.Tensor,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int, need_dparams: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh``, and ``dgamma, dbeta`` in fp32 (empty tensors unless ``need_dparams``)."""
    return _bwd_impl(du, dv, dheads, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams)


def _setup(ctx, inputs, output):
    h, gamma, beta, positions, e, s, gating, rope_base, rope_heads = inputs
    ctx.save_for_backward(h, gamma, positions)
    ctx.args = (e, s, gating, rope_base, rope_heads)
    ctx.param_dtypes = (gamma.dtype, beta.dtype)


def _backward(ctx, du, dv, dheads):
    """Backward of ``lintime::gau_heads_fwd`` (through ``lintime::gau_heads_bwd`` when traced, the launcher in
    eager calls: :meth:`lintime.ops.custom_op.LauncherOp.for_ctx`)."""
    h, gamma, positions = ctx.saved_tensors
    du, dv, dheads = (grad_as(d, h.dtype) for d in (du, dv, dheads))
    need_dparams = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    dh, dgamma, dbeta = gau_heads_bwd.for_ctx(ctx)(du, dv, dheads, h, gamma, positions, *ctx.args, need_dparams)
    if not ctx.needs_input_grad[0]:
        dh = None
    dgamma = dgamma.to(ctx.param_dtypes[0]) if ctx.needs_input_grad[1] else None
    dbeta = dbeta.to(ctx.param_dtypes[1]) if ctx.needs_input_grad[2] else None
    return dh, dgamma, dbeta, None, None, None, None, None, None


@launcher_op("gau_heads_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup)
def gau_heads_fwd(
    h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(h, gamma, beta, positions, e, s, gating, rope_base, rope_heads)


def triton_gau_heads(h, gamma, beta, positions, *, e, s, gating=True, rope_base=10000.0, rope_heads=1):
    """Fused GAU / FLASH heads: same arguments and results as
    :func:`lintime.ops.heads.naive.naive_gau_heads`; fp16 / bf16 / fp32 ``h`` (fp64 goes to the
    PyTorch composite), computed in fp32 and rounded once to ``h``'s dtype."""
    if h.dtype == torch.float64:
        from lintime.ops.heads.chunk import chunk_gau_heads

        return chunk_gau_heads(h, gamma, beta, positions, e=e, s=s, gating=gating, rope_base=rope_base,
                               rope_heads=rope_heads)
    check_device("gau_heads", h)
    args = (h, gamma, beta, positions, int(e), int(s), bool(gating), float(rope_base), int(rope_heads))
    u, v, heads = gau_heads_fwd(*args)  # the op when traced, an autograd Function or the launcher in eager calls
    return (u if gating else None), v, heads
