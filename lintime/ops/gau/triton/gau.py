"""GAU attention on the GPU: the slab path (:mod:`lintime.ops.gau.triton.slab`, scores materialised per slab of
rows, the ``E``-wide products as GEMMs) where ``GauLaunch.slab`` is set -- unpacked calls, packed calls of one length,
packed calls whose sequences tile rows (masked) --, else fused Triton kernels with FlashAttention-style tiling
(below).  Neither forms a ``T x T`` tensor.

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` query/key width, ``E`` value width, ``N``
sequences, ``LB = 2T - 1`` bias diagonals.  Each sequence is one *region* of
:mod:`lintime.ops.gau.triton.kernels`; ``relu(scale q.k + b)^2`` tiles are recomputed per ``E``
tile in the forward and dV kernels, and the backward reduces ``dp = do . v`` over all of ``E``
inside one program per query tile.

``lintime::gau_fwd`` / ``lintime::gau_bwd`` are ``torch.library`` custom ops (fake tensors for
``torch.compile``), tied together by ``register_autograd`` and made by :func:`lintime.ops.utils.launching.launcher_op`
(eager calls skip the op dispatch); the public entry is
:func:`triton_gau_attention`, registered as the ``"triton"`` backend of
:func:`lintime.ops.gau_attention`.
"""

from __future__ import annotations

import functools

import torch

from lintime.ops.utils.bias import fold_bias_grad, kernel_bias
from lintime.ops.gau.triton.kernels import (
    relu2_bwd_dqk_kernel,
    relu2_bwd_dv_kernel,
    relu2_fwd_kernel,
)
from lintime.ops.gau.triton.launch import GauLaunch, bias_tiles, default_launch, tiles_of
from lintime.ops.gau.triton.slab import one_length_run, packed_rows, slab_applies, slab_bwd, slab_fwd
from lintime.ops.utils.launching import cdiv, check_device, dot_config, grad_as, interpreting, launcher_op, to_device
from lintime.ops.utils.tma import tma_descriptors, tma_device
from lintime.ops.utils import packed_cache, sequence_bounds


def _plan(B, T, cu_seqlens, bm, device, packed: dict | None = None):
    """Regions = non-empty sequences (``packed``: a packed call's :func:`_packed` entry, which keeps the tables);
    returns the device tables and the longest sequence.
    Unpacked calls reuse the tables of the same shape (no host work, no copy)."""
    if cu_seqlens is None:
        return _regular_plan(B, T, bm, str(device))
    if "plan" not in packed:
        packed["plan"] = _build_plan(*packed["bounds"], bm, device)
    return packed["plan"]


@functools.lru_cache(maxsize=64)
def _regular_plan(B, T, bm, device):
    return _build_plan(*sequence_bounds(B, T, None), bm, torch.device(device))


def _packed(B, T, cu_seqlens, cfg: GauLaunch, S: int, causal: bool, device) -> dict:
    """A packed call's plan, kept per ``cu_seqlens`` tensor (:func:`lintime.ops.utils.packed_cache`: a model's other
    layers and backward passes skip the host read of ``cu_seqlens`` and the rebuild): ``run`` (all non-empty
    sequences of one length, :func:`~.slab.one_length_run`), ``bounds`` (the sequences), ``mask`` (the rows for the
    masked slab path, :func:`~.slab.packed_rows`, unless the call is one run) and, once built, the tiled kernels'
    ``plan``."""
    entry = packed_cache(cu_seqlens, ("gau", B, T, cfg, S, causal, str(device)))
    if not entry:
        starts, lengths = sequence_bounds(B, T, cu_seqlens)
        run = one_length_run(starts, lengths, cfg, S)
        mask = None if run is not None else packed_rows(starts, lengths, B * T, T, cfg, S, causal, cu_seqlens, device)
        entry.update(run=run, bounds=(starts, lengths), mask=mask)
    return entry


def _whole_slab(packed: dict, T: int, *xs):
    """``(L, views of xs, mask)`` when the slab path takes a packed call whole -- one length (``[n, L]`` views of its
    run) or rows of mixed sequences (``[N / L, L]`` views, pairs across sequences masked) --, else None (the tiled
    kernels)."""
    run, mask = packed["run"], packed["mask"]
    if run is not None:
        s0, n, L = run
        return L, _run_views(T, s0, n, L, *xs), None
    if mask is not None:
        return mask.L, _run_views(T, 0, T // mask.L, mask.L, *xs), mask
    return None


def _run_views(T: int, s0: int, n: int, L: int, *xs):
    """Views ``[n, L, H, D]`` of the packed ``[1, T, H, D]`` tensors ``xs`` over the run ``(s0, n, L)``."""
    return [x[0, s0:s0 + n * L].view(n, L, *x.shape[2:]) for x in xs]


def _run_bias(rel_bias, T: int, L: int):
    """The ``[H, 2L - 1]`` diagonals of a packed call's ``[H, 2T - 1]`` bias that sequences of length ``L`` use."""
    return None if rel_bias is None else rel_bias[:, T - L:T + L - 1]


def _build_plan(starts, lengths, bm, device):
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    reg, off = tiles_of(lengths, bm)
    longest = int(lengths.max()) if lengths.numel() else 0
    # heavy tiles first (causal calls): a query tile's work grows with its offset, a key tile's with the tokens after
    # it; programs start roughly in grid order, so the longest ones no longer make the tail of the launch
    qo = torch.argsort(off, descending=True, stable=True)
    ko = torch.argsort(lengths[reg] - off, descending=True, stable=True)
    tables = to_device(device, reg, off, starts, lengths, reg[qo], off[qo], reg[ko], off[ko])
    return tables, reg.numel(), longest


def _tile_tables(tables, causal: bool, side: str):
    """``(TILE_REG, TILE_OFF)`` in the order the kernels' programs take them: causal calls heaviest first (``side``
    'q': query tiles, 'k': key tiles), others in natural order."""
    if causal:
        return tables[4:6] if side == "q" else tables[6:8]
    return tables[0:2]


def _fwd_fake(q, k, v, rel_bias, cu_seqlens, scale, causal, launch):
    return torch.empty_like(v)


def _gau_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, causal: bool, launch: list[int],
) -> torch.Tensor:
    """``o``; ``launch``: the :class:`GauLaunch` as :meth:`~lintime.ops.utils.launching.LaunchConfig.to_ints`."""
    return _fwd_impl(q, k, v, rel_bias, cu_seqlens, scale, causal, GauLaunch.of(launch))


def _tma(cfg: GauLaunch, S: int, E: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels load whole tiles through TMA descriptors (``GauLaunch.tma``, a TMA device,
    16-bit inputs, ``S`` one whole step, ``E`` a multiple of every ``E`` tile).  fp32 inputs keep the
    pointer loads on a GPU: the TMA pipeline's buffers for 512-wide fp32 tiles exceed the GPU's shared
    memory; the interpreter, which has no such limit, takes the TMA path in fp32 too, so the CPU tests
    check it exactly."""
    return bool(cfg.tma and tma_device(device) and (dtype.itemsize == 2 or interpreting()) and S == cfg.bs
                and E % cfg.be_fwd == 0 and E % cfg.be_dv == 0 and E % cfg.be_red == 0)


def _loads(tma: bool, specs: tuple, tiles: torch.Tensor | None, cfg: GauLaunch) -> tuple[tuple, bool, bool]:
    """A kernel's load arguments ``(DQ_, DK_, ..., DB_)``, ``TMA`` and ``TMA_BIAS``: with ``tma`` the TMA
    descriptors of ``specs`` (``(tensor, rows, block)``) and, with a bias, of its tiles (``[H NTD bm, bm]``, ``[bm,
    bm]`` blocks: faster than the tiles by pointers); else the plain
    tensors.  ``DB_`` is a placeholder where the kernels read the tiles by pointers (no descriptor, or an unaligned
    tensor: the pointer path)."""
    plain = tuple(t for t, _, _ in specs)
    bias_tma = tiles is not None
    extra = ((tiles, tiles.shape[0] * tiles.shape[1] * cfg.bm, (cfg.bm, cfg.bm)),) if bias_tma else ()
    d = tma_descriptors(*specs, *extra) if tma else None
    if d is None:
        return (*plain, plain[0]), False, False
    return ((*d,) if bias_tma else (*d, plain[0])), True, bias_tma


def _fwd_impl(q, k, v, rel_bias, cu_seqlens, scale, causal, cfg: GauLaunch):
    """The forward launcher (``lintime::gau_fwd`` and the eager path): the slab path
    (:mod:`lintime.ops.gau.triton.slab`) where it applies, else the tiled kernels."""
    B, T, H, S = q.shape
    if slab_applies(cfg, S, cu_seqlens):
        return slab_fwd(q, k, v, rel_bias, scale, causal, cfg)
    E = v.shape[-1]
    o = torch.empty_like(v)
    packed = _packed(B, T, cu_seqlens, cfg, S, causal, q.device) if cu_seqlens is not None else None
    whole = _whole_slab(packed, T, q, k, v) if packed is not None else None
    if whole is not None:  # packed, taken whole by the slab path
        L, views, mask = whole
        return slab_fwd(*views, _run_bias(rel_bias, T, L), scale, causal, cfg, mask=mask).view(v.shape)
    tables, NT, longest = _plan(B, T, cu_seqlens, cfg.bm, q.device, packed)
    if NT == 0:
        return o
    t_reg, t_off = _tile_tables(tables, causal, "q")
    r_start, r_len = tables[2:4]
    ntd = 2 * cdiv(max(longest, 1), cfg.bm) - 1
    bias = bias_tiles(kernel_bias(rel_bias)[0], ntd, T - 1, cfg.bm)
    grid = (cdiv(E, cfg.be_fwd), NT, H)
    R = B * T
    loads, tma, tma_bias = _loads(_tma(cfg, S, E, q.device, q.dtype),
                                  ((q, R, (cfg.bm, S)), (k, R, (cfg.bm, S)), (v, R, (cfg.bm, cfg.be_fwd))), bias, cfg)
    relu2_fwd_kernel[grid](
        q, k, v, o, bias if bias is not None else q, *loads,
        t_reg, t_off, r_start, r_len,
        float(scale), S, E, H, ntd,
        BM=cfg.bm, BS=cfg.bs, BE=cfg.be_fwd, CAUSAL=causal, HAS_BIAS=bias is not None,
        ONE_S=cfg.bs >= S, PREC=dot_config(q.dtype)[1], TMA=tma, TMA_BIAS=tma_bias, num_warps=cfg.warps_fwd,
        num_stages=cfg.stages,
    )
    return o


def _bwd_fake(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, launch):
    db = rel_bias.new_empty(rel_bias.shape) if (need_db and rel_bias is not None) else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db


def _gau_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, causal: bool, need_db: bool, launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (input dtype) and ``db`` (``[H, 2T-1]`` in ``rel_bias``'s dtype, or
    an empty tensor when not asked for)."""
    return _bwd_impl(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, GauLaunch.of(launch))


gau_bwd = launcher_op("gau_bwd", fake=_bwd_fake)(_gau_bwd)


def _bwd_impl(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, cfg: GauLaunch):
    """The backward launcher (``lintime::gau_bwd`` and the eager path), slab or tiled like the forward."""
    B, T, H, S = q.shape
    if slab_applies(cfg, S, cu_seqlens):
        return slab_bwd(do, q, k, v, rel_bias, scale, causal, need_db, cfg)
    packed = _packed(B, T, cu_seqlens, cfg, S, causal, q.device) if cu_seqlens is not None else None
    whole = _whole_slab(packed, T, do.contiguous(), q, k, v) if packed is not None else None
    if whole is not None:  # packed, taken whole by the slab path
        L, views, mask = whole
        dq, dk, dv, dbr = slab_bwd(*views, _run_bias(rel_bias, T, L), scale, causal, need_db, cfg,
                                   db_dtype=torch.float32, mask=mask)
        db = q.new_empty(0)
        if need_db and rel_bias is not None:  # the [H, 2L - 1] diagonals inside the call's [H, 2T - 1]
            db = torch.zeros(rel_bias.shape, dtype=torch.float32, device=q.device)
            _run_bias(db, T, L).copy_(dbr)
            db = db.to(rel_bias.dtype)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), db
    E = v.shape[-1]
    do = do.contiguous()
    dv = torch.empty_like(v)
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk32 = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    bias, LB = kernel_bias(rel_bias)
    need_db = need_db and bias is not None
    tables, NT, longest = _plan(B, T, cu_seqlens, cfg.bm, q.device, packed)
    r_start, r_len = tables[2:4]
    ntd = 2 * cdiv(max(longest, 1), cfg.bm) - 1
    # (no bias gradient: a 1-element placeholder the kernel never touches, not a fill)
    db_tiles = (torch.zeros((H, ntd, cfg.bm, cfg.bm), dtype=torch.float32, device=q.device) if need_db
                else torch.empty(1, dtype=torch.float32, device=q.device))
    if NT > 0:
        common = {"CAUSAL": causal, "HAS_BIAS": bias is not None, "ONE_S": cfg.bs >= S,
                  "PREC": dot_config(q.dtype)[1], "num_stages": cfg.stages}
        tiles = bias_tiles(bias, ntd, T - 1, cfg.bm)
        b_ptr = tiles if tiles is not None else q
        R, tma = B * T, _tma(cfg, S, E, q.device, q.dtype)
        loads, on, on_bias = _loads(tma, ((q, R, (cfg.bm, S)), (k, R, (cfg.bm, S)), (do, R, (cfg.bm, cfg.be_dv))),
                                    tiles, cfg)
        relu2_bwd_dv_kernel[(cdiv(E, cfg.be_dv), NT, H)](
            q, k, do, dv, b_ptr, *loads,
            *_tile_tables(tables, causal, "k"), r_start, r_len,
            float(scale), S, E, H, ntd,
            BM=cfg.bm, BS=cfg.bs, BE=cfg.be_dv, TMA=on, TMA_BIAS=on_bias, num_warps=cfg.warps_dv, **common,
        )
        loads, on, on_bias = _loads(tma, ((q, R, (cfg.bm, S)), (k, R, (cfg.bm, S)), (v, R, (cfg.bm, cfg.be_red)),
                                          (do, R, (cfg.bm, cfg.be_red))), tiles, cfg)
        relu2_bwd_dqk_kernel[(NT, H)](
            q, k, v, do, dq32, dk32, db_tiles, b_ptr, *loads,
            *_tile_tables(tables, causal, "q"), r_start, r_len,
            float(scale), S, E, H, ntd,
            BM=cfg.bm, BS=cfg.bs, BE=cfg.be_red, NEED_DB=need_db, TMA=on, TMA_BIAS=on_bias,
            num_warps=cfg.warps, **common,
        )
    else:
        dv.zero_()
    db = fold_bias_grad(db_tiles, LB, T - 1, cfg.bm, rel_bias.dtype) if need_db else q.new_empty(0)
    return dq32.to(q.dtype), dk32.to(k.dtype), dv, db


def _setup(ctx, inputs, output):
    q, k, v, rel_bias, cu_seqlens, scale, causal, launch = inputs
    ctx.save_for_backward(q, k, v, rel_bias, cu_seqlens)
    ctx.scale, ctx.causal, ctx.launch = scale, causal, launch


def _backward(ctx, do):
    """Backward of ``lintime::gau_fwd``: through ``lintime::gau_bwd`` when traced (``torch.compile``, opcheck), the
    launcher itself in eager calls (:meth:`lintime.ops.utils.launching.LauncherOp.for_ctx`)."""
    q, k, v, rel_bias, cu_seqlens = ctx.saved_tensors
    do = grad_as(do, q.dtype)
    need_db = rel_bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, db = gau_bwd.for_ctx(ctx)(do, q, k, v, rel_bias, cu_seqlens, ctx.scale, ctx.causal, need_db,
                                          ctx.launch)
    return dq, dk, dv, (db if need_db else None), None, None, None, None


gau_fwd = launcher_op("gau_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup)(_gau_fwd)


def triton_gau_attention(q, k, v, *, causal=True, rel_bias=None, scale, cu_seqlens=None,
                         launch: GauLaunch | None = None):
    """Fused GAU attention: same arguments and result as
    :func:`lintime.ops.gau.naive.naive_gau_attention` (q, k ``[B, T, H, S]``, v ``[B, T, H, E]``,
    rel_bias ``[H, 2T - 1]``); fp16 / bf16 / fp32 inputs, fp32 accumulation.  ``launch``
    overrides the launch configuration and the path (:func:`default_launch`; ``slab = 0`` the tiled kernels, else
    the slab path for unpacked calls with ``S <= 256``).  fp64 inputs go to the chunked PyTorch
    form (Triton's fp64 products are not worth a kernel variant)."""
    if q.dtype == torch.float64:
        from lintime.ops.gau.chunk import chunk_gau_attention

        return chunk_gau_attention(q, k, v, causal=causal, rel_bias=rel_bias, scale=scale, cu_seqlens=cu_seqlens)
    check_device("gau_attention", q)
    S, E = q.shape[-1], v.shape[-1]
    launch = launch or default_launch(S, E)
    q, k, v = (x.contiguous() for x in (q, k, v))
    args = (q, k, v, rel_bias, cu_seqlens, float(scale), bool(causal))
    return gau_fwd(*args, launch.to_ints())  # the op when traced, an autograd Function or the launcher eagerly
