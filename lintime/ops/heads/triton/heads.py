"""GAU / FLASH heads on one fused Triton kernel each way (see :mod:`.kernels`).

``lintime::gau_heads_fwd`` / ``lintime::gau_heads_bwd`` are ``torch.library`` custom ops (fake
tensors for ``torch.compile``) tied together by ``register_autograd``, made by
:func:`lintime.ops.custom_op.launcher_op`: eager calls take the same launchers without the op dispatch.  The public entry is
:func:`triton_gau_heads`, the ``"triton"`` backend of :func:`lintime.ops.gau_heads`.

Memory traffic is the minimum: the forward reads ``h`` once and writes ``u, v, heads``; the
backward reads ``h`` and the three output gradients once and writes ``dh`` once, plus fp32 partial
column sums per row group (``HeadsLaunch.bwd_heads_rows`` rows for ``dgamma`` / ``dbeta`` and the bias
of the ``z`` columns, ``bwd_rows`` for the bias of the ``u`` / ``v`` columns: 2 + 6.6 MB for 32k
tokens, ``nh = 4``, ``W = 3200``, 64 rows), which ``sum`` calls fold in a fixed order (deterministic).  The
backward keeps only the inputs ``h``, ``bias``, ``gamma`` and ``positions`` (the activation is
recomputed).
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
from lintime.ops.launch_tables import LaunchConfig
from lintime.ops.utils import rope_inv_freq


@dataclass(frozen=True)
class HeadsLaunch(LaunchConfig):
    """Launch configuration of the heads kernels (the forward's fields measured on an H200, B * T = 32k, e = 2048,
    s = 128, nh = 4, bf16, 2026-11-22: forward 0.150 ms, 3.85 TB/s; a clone of ``h`` 4.14).  The backward's
    ``bwd_rows`` / ``bwd_warps`` (row groups looped in registers) are not measured yet: ``lab/heads_ab.py``."""

    bt: int = 8  # rows of a u / v tile: long contiguous row segments; 4 x 1024, 16 x 512, 32 x 128 no faster
    be: int = 512  # columns of a u / v tile
    bth: int = 8  # rows of a heads block (forward: one per program; 16 / 32 rows were slower)
    warps: int = 4  # per forward program; 2 or 8 warps no faster
    bwd_rows: int = 64  # rows per backward tile program, a multiple of bt: not measured yet
    bwd_heads_rows: int = 64  # rows per backward heads program, a multiple of bth: not measured yet
    bwd_warps: int = 4  # per backward program: not measured yet

    def __post_init__(self):
        if self.bwd_rows % self.bt or self.bwd_heads_rows % self.bth:
            raise ValueError(f"HeadsLaunch: bwd_rows={self.bwd_rows} must be a multiple of bt={self.bt} and "
                             f"bwd_heads_rows={self.bwd_heads_rows} of bth={self.bth}")


def default_launch(device: torch.device) -> HeadsLaunch:
    """The GPU's :class:`HeadsLaunch`; under the interpreter 16 x 16 tiles, 16-row heads blocks and backward
    groups of 32 (tiles) and 48 (heads) rows, so that small test shapes cross several row blocks, row groups and
    ``u`` / ``v`` tiles, with partial ones."""
    if device.type == "cpu" and interpreting():
        return HeadsLaunch(bt=16, be=16, bth=16, warps=1, bwd_rows=32, bwd_heads_rows=48, bwd_warps=1)
    return HeadsLaunch()


def _fwd_grid(TT, e, gating, cfg: HeadsLaunch):
    """Heads programs then tile programs (:mod:`.kernels`)."""
    return (cdiv(TT, cfg.bth) + cdiv(TT, cfg.bt) * (2 if gating else 1) * cdiv(e, cfg.be),)


def _bwd_grid(TT, e, gating, cfg: HeadsLaunch):
    """Heads programs then tile programs, one row group each, and the numbers of heads and tile row groups."""
    heads, tiles = cdiv(TT, cfg.bwd_heads_rows), cdiv(TT, cfg.bwd_rows)
    return (heads + tiles * (2 if gating else 1) * cdiv(e, cfg.be),), heads, tiles


@functools.lru_cache(maxsize=32)
def _inv_freq(half: int, base: float, device: str) -> torch.Tensor:
    """The fp32 RoPE frequencies of :func:`lintime.ops.utils.rope` (cached per call shape), so the angles match."""
    return rope_inv_freq(half, base, torch.float32, device)


def _layout(h, gamma, s, rope_heads):
    B, T, W = h.shape
    hd = s // rope_heads // 2
    return B, T, W, B * T, gamma.shape[0], hd


def _fwd_impl(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, launch=None):
    """The forward launcher: ``(u, v, heads)``, ``u`` an empty tensor without gating."""
    cfg = HeadsLaunch.of(launch) if launch is not None else default_launch(h.device)
    B, T, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    h, gamma, beta, positions = (x.contiguous() for x in (h, gamma, beta, positions))
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    v = h.new_empty(B, T, e)
    heads = h.new_empty(B, T, nh, s)
    if TT == 0:
        return u, v, heads
    gau_heads_fwd_kernel[_fwd_grid(TT, e, gating, cfg)](
        h, h if bias is None else bias.contiguous(), u if gating else v, v, heads, gamma, beta, positions,
        _inv_freq(hd, rope_base, str(h.device)),
        TT, e, W,
        S=s, NH=nh, HD=hd, GATING=gating, HAS_BIAS=bias is not None, BT=cfg.bt, BE=cfg.be, BTH=cfg.bth,
        BH=next_pow2(s // 2), num_warps=cfg.warps,
    )
    return u, v, heads


def _bwd_impl(du, dv, dheads, h, gamma, positions, bias, e, s, gating, rope_base, rope_heads, need_dparams,
              need_dbias, launch=None):
    """The backward launcher: ``dh`` (``h``'s dtype); when ``need_dparams``, ``dgamma`` and ``dbeta`` as fp32
    ``[nh, s]``, and when ``need_dbias``, ``dbias`` as fp32 ``[W]`` (else empty tensors).  ``None`` gradients count
    as zero."""
    cfg = HeadsLaunch.of(launch) if launch is not None else default_launch(h.device)
    _, _, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    du = du if (gating and du is not None and du.numel()) else None
    h, gamma, positions = (x.contiguous() for x in (h, gamma, positions))
    du, dv, dheads, bias = (None if x is None else x.contiguous() for x in (du, dv, dheads, bias))
    dh = torch.empty_like(h)
    need_part = need_dparams and dheads is not None and TT > 0
    need_db = need_dbias and TT > 0
    grid, groups_h, groups_t = _bwd_grid(TT, e, gating, cfg)
    f32 = {"dtype": torch.float32, "device": h.device}
    part = torch.empty(2, groups_h, nh, s, **f32) if need_part else torch.empty(1, **f32)
    db_part, db_part_z = part, part  # (unused pointers)
    if need_db:
        db_part, db_part_z = torch.empty(groups_t, W - s, **f32), torch.empty(groups_h, s, **f32)
    if TT > 0:
        gau_heads_bwd_kernel[grid](
            h, h if bias is None else bias, du if du is not None else h, dv if dv is not None else h,
            dheads if dheads is not None else h, gamma, positions, _inv_freq(hd, rope_base, str(h.device)), dh,
            part[0], part[-1], db_part, db_part_z,
            TT, e, W,
            S=s, NH=nh, NHP=next_pow2(nh), HD=hd, GATING=gating, HAS_BIAS=bias is not None,
            HAS_DU=du is not None, HAS_DV=dv is not None, HAS_DHEADS=dheads is not None, NEED_DP=need_part,
            NEED_DB=need_db, BT=cfg.bt, BE=cfg.be, BTH=cfg.bth, BH=next_pow2(s // 2), ROWS=cfg.bwd_rows,
            ROWS_H=cfg.bwd_heads_rows, num_warps=cfg.bwd_warps,
        )
    # (separate tensors, not views of one: a custom op's outputs may not alias each other)
    if need_part:
        dgamma, dbeta = part[0].sum(0), part[1].sum(0)
    elif need_dparams:  # no gradient reaches the heads
        dgamma, dbeta = torch.zeros(nh, s, **f32), torch.zeros(nh, s, **f32)
    else:
        dgamma, dbeta = h.new_empty(0, dtype=torch.float32), h.new_empty(0, dtype=torch.float32)
    if need_db:
        dbias = torch.empty(W, **f32)
        torch.sum(db_part, 0, out=dbias[: W - s])
        torch.sum(db_part_z, 0, out=dbias[W - s :])
    else:
        dbias = torch.zeros(W, **f32) if need_dbias else h.new_empty(0, dtype=torch.float32)
    return dh, dgamma, dbeta, dbias


# ---------------------------------------------------------------------------------------------
# custom ops (torch.compile) and the eager Function


def _fwd_fake(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, launch):
    B, T, _ = h.shape
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    return u, h.new_empty(B, T, e), h.new_empty(B, T, gamma.shape[0], s)


def _bwd_fake(du, dv, dheads, h, gamma, positions, bias, e, s, gating, rope_base, rope_heads, need_dparams,
              need_dbias, launch):
    shape = tuple(gamma.shape) if need_dparams else (0,)
    f32 = lambda *size: h.new_empty(size, dtype=torch.float32)
    return torch.empty_like(h), f32(*shape), f32(*shape), f32(h.shape[-1] if need_dbias else 0)


@launcher_op("gau_heads_bwd", fake=_bwd_fake)
def gau_heads_bwd(
    du: torch.Tensor | None, dv: torch.Tensor | None, dheads: torch.Tensor | None,
    h: torch.Tensor, gamma: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int, need_dparams: bool, need_dbias: bool,
    launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh``, and ``dgamma, dbeta`` and ``dbias`` in fp32 (empty tensors unless ``need_dparams`` /
    ``need_dbias``)."""
    return _bwd_impl(du, dv, dheads, h, gamma, positions, bias, e, s, gating, rope_base, rope_heads, need_dparams,
                     need_dbias, launch)


def _setup(ctx, inputs, output):
    h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, launch = inputs
    ctx.save_for_backward(h, gamma, positions, bias)
    ctx.args = (e, s, gating, rope_base, rope_heads)
    ctx.launch = launch
    ctx.param_dtypes = (gamma.dtype, beta.dtype, None if bias is None else bias.dtype)


def _backward(ctx, du, dv, dheads):
    """Backward of ``lintime::gau_heads_fwd`` (through ``lintime::gau_heads_bwd`` when traced, the launcher in
    eager calls: :meth:`lintime.ops.custom_op.LauncherOp.for_ctx`)."""
    h, gamma, positions, bias = ctx.saved_tensors
    du, dv, dheads = (grad_as(d, h.dtype) for d in (du, dv, dheads))
    need_dparams = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    need_dbias = ctx.needs_input_grad[4]
    dh, dgamma, dbeta, dbias = gau_heads_bwd.for_ctx(ctx)(du, dv, dheads, h, gamma, positions, bias, *ctx.args,
                                                          need_dparams, need_dbias, ctx.launch)
    if not ctx.needs_input_grad[0]:
        dh = None
    dgamma = dgamma.to(ctx.param_dtypes[0]) if ctx.needs_input_grad[1] else None
    dbeta = dbeta.to(ctx.param_dtypes[1]) if ctx.needs_input_grad[2] else None
    dbias = dbias.to(ctx.param_dtypes[2]) if need_dbias else None
    return dh, dgamma, dbeta, None, dbias, None, None, None, None, None, None


@launcher_op("gau_heads_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup)
def gau_heads_fwd(
    h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int, launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, launch)


def triton_gau_heads(h, gamma, beta, positions, *, e, s, gating=True, rope_base=10000.0, rope_heads=1, bias=None,
                     launch: HeadsLaunch | None = None):
    """Fused GAU / FLASH heads: same arguments and results as
    :func:`lintime.ops.heads.naive.naive_gau_heads`; fp16 / bf16 / fp32 ``h`` (fp64 goes to the
    PyTorch composite), computed in fp32 and rounded once to ``h``'s dtype.  ``launch`` overrides
    :func:`default_launch` (tests, ``lab/heads_ab.py``)."""
    if h.dtype == torch.float64:
        from lintime.ops.heads.chunk import chunk_gau_heads

        return chunk_gau_heads(h, gamma, beta, positions, e=e, s=s, gating=gating, rope_base=rope_base,
                               rope_heads=rope_heads, bias=bias)
    check_device("gau_heads", h)
    launch = launch or default_launch(h.device)
    args = (h, gamma, beta, positions, bias, int(e), int(s), bool(gating), float(rope_base), int(rope_heads),
            launch.to_ints())
    u, v, heads = gau_heads_fwd(*args)  # the op when traced, an autograd Function or the launcher in eager calls
    return (u if gating else None), v, heads
