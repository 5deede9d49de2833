"""GAU / FLASH heads on one fused Triton kernel each way (see :mod:`.kernels`).

``lintime::gau_heads_fwd`` / ``lintime::gau_heads_bwd`` (the heads as one tensor) and
``lintime::gau_heads_split_fwd`` / ``_split_bwd`` (as ``nh`` tensors) are ``torch.library`` custom ops (fake
tensors for ``torch.compile``) tied together by ``register_autograd``, made by
:func:`lintime.ops.utils.launching.launcher_op`: eager calls take the same launchers without the op dispatch.  The public entry is
:func:`triton_gau_heads`, the ``"triton"`` backend of :func:`lintime.modules.gau_heads`.

Memory traffic is the minimum: the forward reads ``h`` once and writes ``u, v`` and the heads (one
``[B, T, nh, s]`` tensor, or with ``split_heads`` ``nh <= 6`` contiguous ``[B, T, 1, s]`` tensors, written
directly: no copies); the backward reads ``h`` and the output gradients once (the heads' as one tensor or as
``nh`` separate ones, any of them absent) and writes ``dh`` once, plus ``[cdiv(TT, bth rb), nh, s]`` fp32
partial sums of ``dgamma`` / ``dbeta`` (``rb`` row blocks per program, summed in registers: 1 MB for 32k
tokens, ``nh = 4``, ``bth = 8``, ``rb = 16``), which :func:`lintime.ops.fold.fold_rows` folds in a fixed order
(deterministic).
With a ``bias`` (the projection's, added by the kernels: the product runs without it) the backward also writes
``[cdiv(TT, bth rb), W]`` fp32 partial column sums of ``dh`` (1.7 MB at ``W = 1664``), folded in the same launch:
the bias gradient without reading ``dh`` again.  The backward keeps only the inputs ``h``, ``gamma``,
``positions`` and ``bias`` (the activation is recomputed).
"""

from __future__ import annotations

import functools

import torch

from lintime.modules.heads import MAX_SPLIT_HEADS
from lintime.modules.heads.triton.kernels import (
    gau_heads_bwd_kernel,
    gau_heads_bwd_tiles_kernel,
    gau_heads_fwd_kernel,
)
from lintime.modules.heads.triton.launch import HeadsLaunch, default_launch
from lintime.ops.fold import fold_rows
from lintime.ops.utils.launching import cdiv, check_device, grad_as, launcher_op, next_pow2
from lintime.ops.utils import rope_inv_freq


def _fwd_grid(TT, e, gating, cfg: HeadsLaunch):
    """The forward's grid: heads programs of ``bth`` rows, then tile programs of ``bt`` rows (:mod:`.kernels`)."""
    ne = cdiv(e, cfg.be)
    return (cdiv(TT, cfg.bth) + cdiv(TT, cfg.bt) * (2 * ne if gating else ne),)


@functools.lru_cache(maxsize=32)
def _inv_freq(half: int, base: float, device: str) -> torch.Tensor:
    """The fp32 RoPE frequencies of :func:`lintime.ops.utils.rope` (cached per call shape), so the angles match."""
    return rope_inv_freq(half, base, torch.float32, device)


def _layout(h, gamma, s, rope_heads):
    B, T, W = h.shape
    hd = s // rope_heads // 2
    return B, T, W, B * T, gamma.shape[0], hd


def _head_args(qs: list[torch.Tensor | None], stacked: bool, nh: int, s: int):
    """The kernels' six head pointers, ``HS``, ``SQ`` and present-gradient mask for the heads (or their
    gradients) ``qs``: ``[one [B, T, nh, s] tensor]`` when ``stacked``, else ``nh`` separate ``[B, T, 1, s]``
    tensors, ``None`` for an absent one (all contiguous, at least one present)."""
    if stacked:
        return [qs[0]] * MAX_SPLIT_HEADS, s, nh * s, (1 << nh) - 1
    ref = next(q for q in qs if q is not None)
    mask = sum(1 << n for n, q in enumerate(qs) if q is not None)
    return [ref if q is None else q for q in qs] + [ref] * (MAX_SPLIT_HEADS - len(qs)), 0, s, mask


def _fwd_impl(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, split,
              cfg: HeadsLaunch | None = None):
    """The forward launcher: ``(u, v, heads)`` with ``heads`` one ``[B, T, nh, s]`` tensor, or with ``split`` a
    list of ``nh`` ``[B, T, 1, s]`` tensors; ``u`` an empty tensor without gating.  ``bias``: ``[W]`` or
    ``None``."""
    cfg = cfg or default_launch(h.device)
    B, T, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    h, gamma, beta, positions = (x.contiguous() for x in (h, gamma, beta, positions))
    bias = None if bias is None else bias.contiguous()
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    v = h.new_empty(B, T, e)
    qs = [h.new_empty(B, T, 1, s) for _ in range(nh)] if split else [h.new_empty(B, T, nh, s)]
    if TT == 0:
        return u, v, (qs if split else qs[0])
    ptrs, hs, sq, _ = _head_args(qs, not split, nh, s)
    grid = _fwd_grid(TT, e, gating, cfg)
    gau_heads_fwd_kernel[grid](
        h, h if bias is None else bias, u if gating else v, v, *ptrs, gamma, beta, positions,
        _inv_freq(hd, rope_base, str(h.device)), TT, e, W, sq,
        S=s, NH=nh, HD=hd, HS=hs, GATING=gating, HAS_BIAS=bias is not None, BT=cfg.bt, BE=cfg.be, BTH=cfg.bth,
        BH=next_pow2(s // 2),
        num_warps=cfg.warps,
    )
    return u, v, (qs if split else qs[0])


def _bwd_impl(du, dv, dqs, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams,
              cfg: HeadsLaunch | None = None, bias: torch.Tensor | None = None, need_dbias: bool = True):
    """The backward launcher: ``dh`` (``h``'s dtype), when ``need_dparams`` ``dgamma`` and ``dbeta`` as fp32
    ``[nh, s]``, when ``bias`` is given and ``need_dbias`` ``dbias`` as fp32 ``[W]`` (else empty tensors).
    ``dqs``: the heads' gradient, a tensor ``[B, T, nh, s]`` or a list of ``nh`` ``[B, T, 1, s]`` ones.  ``None``
    gradients count as zero."""
    cfg = cfg or default_launch(h.device)
    _, _, W, TT, nh, hd = _layout(h, gamma, s, rope_heads)
    du = du if (gating and du is not None and du.numel()) else None
    h, gamma, positions = (x.contiguous() for x in (h, gamma, positions))
    bias = None if bias is None else bias.contiguous()
    need_db = bias is not None and need_dbias
    du, dv = (None if x is None else x.contiguous() for x in (du, dv))
    stacked = not isinstance(dqs, (list, tuple))
    dqs = [None if x is None or x.numel() == 0 else x.contiguous() for x in ([dqs] if stacked else dqs)]
    has_dq = any(x is not None for x in dqs)
    dh = torch.empty_like(h)
    need_part = need_dparams and has_dq and TT > 0
    nhb, ntb, ne = cdiv(TT, cfg.bth * cfg.rb), cdiv(TT, cfg.bt * cfg.tr), cdiv(e, cfg.be)
    f32 = {"dtype": torch.float32, "device": h.device}
    part = torch.empty(2, nhb, nh * s, **f32) if need_part else torch.empty(1, **f32)
    part_z = torch.empty(nhb, s, **f32) if need_db else part  # the bias gradient's partial rows: z columns
    part_t = torch.empty(ntb, W - s, **f32) if need_db else part  # u, v columns
    if has_dq:
        ptrs, hs, sq, mask = _head_args(dqs, stacked, nh, s)
    else:
        ptrs, hs, sq, mask = [h] * MAX_SPLIT_HEADS, 0, s, 0
    if TT > 0:
        b = h if bias is None else bias
        gau_heads_bwd_kernel[(nhb,)](
            h, b, *ptrs, gamma, positions, _inv_freq(hd, rope_base, str(h.device)), dh, part[0], part[-1], part_z,
            TT, W, sq,
            S=s, NH=nh, HD=hd, HS=hs, HAS_DQ=mask, NEED_DP=need_part, HAS_BIAS=bias is not None, NEED_DB=need_db,
            BTH=cfg.bth, RB=cfg.rb, BH=next_pow2(s // 2), num_warps=cfg.warps,
        )
        gau_heads_bwd_tiles_kernel[(ntb * (2 * ne if gating else ne),)](
            h, b, du if du is not None else h, dv if dv is not None else h, dh, part_t, TT, e, W, s,
            GATING=gating, HAS_DU=du is not None, HAS_DV=dv is not None, HAS_BIAS=bias is not None, NEED_DB=need_db,
            BT=cfg.bt, BE=cfg.be, TR=cfg.tr, num_warps=cfg.warps,
        )
    # the partial rows folded in one launch (separate outputs: a custom op's outputs may not alias each other)
    dgamma, dbeta = (torch.empty(nh, s, **f32), torch.empty(nh, s, **f32)) if need_part else (None, None)
    dbias = torch.empty(W, **f32) if need_db else None
    parts, outs = [], []
    if need_part:
        parts, outs = [part[0], part[1]], [dgamma.view(-1), dbeta.view(-1)]
    if need_db:
        parts, outs = parts + [part_t, part_z], outs + [dbias[: W - s], dbias[W - s:]]
    if parts:
        fold_rows(parts, outs)
    if not need_part:
        shape = (nh, s) if need_dparams else (0,)  # need_dparams: no gradient reaches the heads
        dgamma, dbeta = torch.zeros(shape, **f32), torch.zeros(shape, **f32)
    return dh, dgamma, dbeta, (dbias if need_db else h.new_empty(0, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# custom ops (torch.compile) and the eager Function


def _fwd_fake(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads):
    B, T, _ = h.shape
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    return u, h.new_empty(B, T, e), h.new_empty(B, T, gamma.shape[0], s)


def _split_fwd_fake(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads):
    B, T, _ = h.shape
    u = h.new_empty(B, T, e) if gating else h.new_empty(0)
    nh = gamma.shape[0]
    qs = [h.new_empty(B, T, 1, s) if n < nh else h.new_empty(0) for n in range(MAX_SPLIT_HEADS)]
    return u, h.new_empty(B, T, e), *qs


def _dparams_fake(h, gamma, bias, need_dparams, need_dbias):
    shape = tuple(gamma.shape) if need_dparams else (0,)
    f32 = {"dtype": torch.float32}
    db = h.new_empty((h.shape[-1],) if bias is not None and need_dbias else (0,), **f32)
    return torch.empty_like(h), h.new_empty(shape, **f32), h.new_empty(shape, **f32), db


def _bwd_fake(du, dv, dheads, h, gamma, positions, bias, e, s, gating, rope_base, rope_heads, need_dparams,
              need_dbias):
    return _dparams_fake(h, gamma, bias, need_dparams, need_dbias)


def _split_bwd_fake(du, dv, dq0, dq1, dq2, dq3, dq4, dq5, h, gamma, positions, bias, e, s, gating, rope_base,
                    rope_heads, need_dparams, need_dbias):
    return _dparams_fake(h, gamma, bias, need_dparams, need_dbias)


@launcher_op("gau_heads_bwd", fake=_bwd_fake)
def gau_heads_bwd(
    du: torch.Tensor | None, dv: torch.Tensor | None, dheads: torch.Tensor | None,
    h: torch.Tensor, gamma: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int, need_dparams: bool, need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh``, ``dgamma, dbeta`` in fp32 (empty tensors unless ``need_dparams``) and ``dbias`` in fp32 (an empty
    tensor unless ``bias`` is given and ``need_dbias``)."""
    return _bwd_impl(du, dv, dheads, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams,
                     bias=bias, need_dbias=need_dbias)


@launcher_op("gau_heads_split_bwd", fake=_split_bwd_fake)
def gau_heads_split_bwd(
    du: torch.Tensor | None, dv: torch.Tensor | None,
    dq0: torch.Tensor | None, dq1: torch.Tensor | None, dq2: torch.Tensor | None,
    dq3: torch.Tensor | None, dq4: torch.Tensor | None, dq5: torch.Tensor | None,
    h: torch.Tensor, gamma: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int, need_dparams: bool, need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gau_heads_bwd` with the heads' gradient as ``nh`` separate ``[B, T, 1, s]`` tensors (those of
    heads ``>= nh`` are ignored)."""
    dqs = [dq0, dq1, dq2, dq3, dq4, dq5][: gamma.shape[0]]
    return _bwd_impl(du, dv, dqs, h, gamma, positions, e, s, gating, rope_base, rope_heads, need_dparams,
                     bias=bias, need_dbias=need_dbias)


def _setup(ctx, inputs, output):
    h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads = inputs
    ctx.save_for_backward(h, gamma, positions, bias)
    ctx.args = (e, s, gating, rope_base, rope_heads)
    ctx.param_dtypes = (gamma.dtype, beta.dtype, None if bias is None else bias.dtype)


def _input_grads(ctx, launcher, du, dv, *dqs):
    """The gradients of ``h, gamma, beta, bias`` (``None`` for the other inputs) through ``launcher`` (the bwd op
    when traced, its launcher in eager calls: :meth:`lintime.ops.utils.launching.LauncherOp.for_ctx`)."""
    h, gamma, positions, bias = ctx.saved_tensors
    du, dv, *dqs = (grad_as(d, h.dtype) for d in (du, dv, *dqs))
    need = ctx.needs_input_grad
    need_dparams, need_dbias = need[1] or need[2], bias is not None and need[4]
    dh, dgamma, dbeta, dbias = launcher.for_ctx(ctx)(du, dv, *dqs, h, gamma, positions, bias, *ctx.args,
                                                     need_dparams, need_dbias)
    dh = dh if need[0] else None
    dgamma = dgamma.to(ctx.param_dtypes[0]) if need[1] else None
    dbeta = dbeta.to(ctx.param_dtypes[1]) if need[2] else None
    dbias = dbias.to(ctx.param_dtypes[2]) if need_dbias else None
    return dh, dgamma, dbeta, None, dbias, None, None, None, None, None


def _backward(ctx, du, dv, dheads):
    """Backward of ``lintime::gau_heads_fwd``."""
    return _input_grads(ctx, gau_heads_bwd, du, dv, dheads)


def _split_backward(ctx, du, dv, *dqs):
    """Backward of ``lintime::gau_heads_split_fwd``: the heads' gradients go to the kernel as they are."""
    return _input_grads(ctx, gau_heads_split_bwd, du, dv, *dqs)


@launcher_op("gau_heads_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup)
def gau_heads_fwd(
    h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, False)


@launcher_op("gau_heads_split_fwd", fake=_split_fwd_fake, backward=_split_backward, setup_context=_setup)
def gau_heads_split_fwd(
    h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
    e: int, s: int, gating: bool, rope_base: float, rope_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """``u, v`` and six head slots: heads ``0 .. nh - 1`` as ``[B, T, 1, s]`` tensors, empty tensors after them
    (a custom op has a fixed number of outputs)."""
    u, v, qs = _fwd_impl(h, gamma, beta, positions, bias, e, s, gating, rope_base, rope_heads, True)
    return u, v, *qs, *(h.new_empty(0) for _ in range(MAX_SPLIT_HEADS - len(qs)))


def triton_gau_heads(h, gamma, beta, positions, *, e, s, gating=True, rope_base=10000.0, rope_heads=1,
                     split_heads=False, bias=None):
    """Fused GAU / FLASH heads: same arguments and results as
    :func:`lintime.modules.heads.naive.naive_gau_heads`; fp16 / bf16 / fp32 ``h`` (fp64 goes to the
    PyTorch composite), computed in fp32 and rounded once to ``h``'s dtype."""
    if h.dtype == torch.float64:
        from lintime.modules.heads.chunk import chunk_gau_heads

        return chunk_gau_heads(h, gamma, beta, positions, e=e, s=s, gating=gating, rope_base=rope_base,
                               rope_heads=rope_heads, split_heads=split_heads, bias=bias)
    check_device("gau_heads", h)
    args = (h, gamma, beta, positions, bias, int(e), int(s), bool(gating), float(rope_base), int(rope_heads))
    # the op when traced, an autograd Function or the launcher in eager calls
    if split_heads:
        u, v, *qs = gau_heads_split_fwd(*args)
        return (u if gating else None), v, tuple(qs[: gamma.shape[0]])
    u, v, heads = gau_heads_fwd(*args)
    return (u if gating else None), v, heads
