"""GAU attention on the GPU: the slab path (:mod:`lintime.ops.gau.triton.slab`, scores materialised per slab of
rows, the ``E``-wide products as GEMMs) where ``Blocks.slab`` is set -- unpacked calls, packed calls of one length,
packed calls whose sequences tile rows (masked) --, else fused Triton kernels with FlashAttention-style tiling
(below).  Neither forms a ``T x T`` tensor.

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` query/key width, ``E`` value width, ``N``
sequences, ``LB = 2T - 1`` bias diagonals.  Each sequence is one *region* of
:mod:`lintime.ops.gau.triton.kernels`; ``relu(scale q.k + b)^2`` tiles are recomputed per ``E``
tile in the forward and dV kernels, and the backward reduces ``dp = do . v`` over all of ``E``
inside one program per query tile.

``lintime::gau_fwd`` / ``lintime::gau_bwd`` are ``torch.library`` custom ops (fake tensors for
``torch.compile``), tied together by ``register_autograd``; the public entry is
:func:`triton_gau_attention`, registered as the ``"triton"`` backend of
:func:`lintime.ops.gau_attention`.
"""

from __future__ import annotations

import functools

import torch

from lintime.ops.gau.triton.kernels import (
    relu2_bwd_dqk_kernel,
    relu2_bwd_dv_kernel,
    relu2_fwd_kernel,
)
from lintime.ops.gau.triton.plan import (
    Blocks,
    bias_tiles,
    blocks_of,
    default_blocks,
    fold_bias_grad,
    kernel_bias,
    sequence_bounds,
    tiles_of,
    to_device,
)
from lintime.ops.gau.triton.slab import packed_rows, slab_applies, slab_bwd, slab_fwd, slab_runs
from lintime.ops.custom_op import custom_op
from lintime.ops.kernel_launch import cdiv, check_device, dot_config, interpreting
from lintime.ops.tma import tma_descriptors, tma_device
from lintime.ops.utils import packed_cache

# Candidate launches of the three GAU kernels: ``(name, overrides)``, the overrides applied to the GPU
# defaults of the shape (:func:`lintime.ops.gau.triton.plan.variant_blocks`; defaults BM = 64, S step
# 128, forward BE = 256 with 8 warps, dV BE = 128, E step 128 in the dq/dk kernel, 4 warps in the
# backward, 2 stages).  Timed side by side
# by ``lintime bench ops --cases flash.variants`` and run against the naive form by the CUDA test
# ``test_launch_variants`` (the tile-changing ones also under the interpreter) -- a variant becomes a
# default only after both, on the GPU.  H200, 2026-11-22, CUDA-graph fwd / fwd+bwd at T = 4k (ms;
# docs/notes/kernels_flash.md): E step 64 (the default before) 2.91 / 8.54, E step 128 2.91 / 7.93
# (default since), "w8" 4.84 / 13.01, "bm128_w8" 3.04 / 9.00, "be256_w8" 2.57 / 9.20, "s3" 3.67 / 9.50.
LAUNCH_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("default", {}),  # plan.default_blocks; each promotion's measurement is noted there and below
    # pointer loads (pre-Hopper GPUs, S != the S step, unaligned inputs): 4.86 vs 3.94 ms fwd+bwd at 4k with
    # TMA (H200, 2026-11-22 session 7)
    ("no_tma", {"tma": 0}),
    # the bias tiles by pointer loads while everything else loads through TMA (session 9, H200, fwd+bwd at 4k:
    # 3.85 vs 3.60 ms; the [64, 64] gather of the bias per tile that the tiles replaced: 4.01)
    ("bias_ptr", {"tma_bias": 0}),
    ("tma_be256", {"be_fwd": 256, "be_dv": 256}),  # TMA boxes of at most 256 columns: 6.23 ms (same run)
    # with TMA (same session, default 3.96 ms): 8 warps in the dq/dk kernel 4.80 ("w8" 4.80, "bm128_w8" 7.12,
    # "ered256" -- E step 256 in the dq/dk kernel's do . v reduction -- 4.45)
    ("dqk_w8", {"warps_gau": 8}),
    ("fwd_be128_w4", {"be_fwd": 128, "warps_gau_fwd": 4}),  # the forward before 2026-11-22 (2.91 vs 2.57 ms)
    ("fwd_be128_w8", {"be_fwd": 128}),
    # the forward's tiling for the dV pass (scores per 256 of E): 7.66 vs 7.63 ms at 4k -- no gain (H200,
    # 2026-11-22); 8 warps on 128-wide dV tiles 9.22
    ("dv_be256_w8", {"be_dv": 256, "warps_gau_dv": 8}),
    ("dv_w8", {"be_dv": 128, "warps_gau_dv": 8}),
    ("w8", {"warps_gau": 8, "warps_gau_fwd": 8, "warps_gau_dv": 8}),  # 8 warps on the 64-row tiles
    # 128-row query / key tiles (with the 256-wide forward E tile: 288 KB of shared memory, over the limit; 2 stages
    # in its forward: 3 would need ~224 KB)
    ("bm128_w8", {"bm": 128, "be_fwd": 128, "be_dv": 128, "warps_gau": 8, "warps_gau_fwd": 8, "warps_gau_dv": 8,
                  "stages_gau_fwd": 2}),
    ("be256_w8", {"be_fwd": 256, "be_dv": 256, "warps_gau": 8, "warps_gau_fwd": 8, "warps_gau_dv": 8}),  # half the score recomputation per E
    ("ered256", {"be_red_gau": 256}),
    # causal: the programs of the longest tiles start first (H200, 2026-11-22 08:33 UTC, CUDA-graph fwd /
    # fwd+bwd at 4k: default then 2.58 / 7.57 ms, both passes heavy first 2.78 / 7.51, with 3 stages 2.19 /
    # 7.51); 08:37 UTC: heaviest first in both passes + 3 stages in the forward only 2.20 / 6.92 (the default
    # since), forward in natural order 2.27 / 6.99, the default before 2.58 / 7.59
    ("natural_order_s2", {"gau_order": 0, "stages_gau_fwd": 0}),  # the default before 08:37 UTC
    ("bwd_heavy", {"gau_order": 2}),
    # Measured on an H200 and removed (code in commit ada80ee): in the dq/dk kernel, key tiles from the diagonal
    # down (7.19 vs 6.89 ms fwd+bwd at 4k) and 8 copies of the bias-gradient blocks (6.95) against atomics
    # contention, one key tile per pass over E (6.84 vs 6.38 with pairs, the default since 08:54 UTC), 3 / 4
    # pipeline stages for that kernel alone (5.28 / 5.30 vs 4.88).
    ("ered64", {"be_red_gau": 64}),  # E step 64: 8.54 vs 7.93 ms with 128 before pairs, 6.60 vs 6.38 with them
    # wider E tiles: the dV pass recomputes its scores once per E tile (at 128 wide its score recomputation
    # equals its useful work), the forward likewise.  H200 09:00 UTC, fwd / fwd+bwd at 4k: default then (forward
    # 256 wide, 3 stages) 2.20 / 6.38 ms, forward 512 wide with 2 stages 1.55 / 5.73 (the default since), dV 256
    # wide with 4 warps 2.20 / 6.67.  09:04 UTC: dV 512 wide with 8 warps 1.54 / 4.83 vs 1.55 / 5.72 (the
    # default since); a forward 1024 wide with 16 warps and 1 stage crashed Triton 3.6's compiler (removed)
    ("fwd_be256_s3", {"be_fwd": 256, "stages_gau_fwd": 3}),  # the forward before 09:00 UTC
    ("dv_be128_w4", {"be_dv": 128, "warps_gau_dv": 4}),  # the dV pass before 09:04 UTC
    ("dv_be256_w4", {"be_dv": 256, "warps_gau_dv": 4}),
    # one stage: ~half the shared memory of the 512-wide tiles, two 8-warp programs per SM instead of one.
    # Slower (H200 09:31 UTC, fwd / fwd+bwd at 4k: default 1.55 / 4.85 ms, fwd_s1 1.94 / 5.23, s1 1.94 / 6.59)
    ("fwd_s1", {"stages_gau_fwd": 1}),
    ("s1", {"stages_gau": 1, "stages_gau_fwd": 1}),
    # Measured on an H200 and removed (session 6, code in commit d65bb21, fwd / fwd+bwd device at 4k against the
    # default's 1.54 / 4.82 ms): 128-row query tiles in the forward with 64-key steps and 256-wide E tiles (each
    # warp group's score rows stay in its registers, FlashAttention's split: 1.75 / 5.02; 3 stages need 240 KB of
    # shared memory), 128-row key tiles in the dV pass (4.87), both (5.08)
    # Measured and removed (session 8, code in commit 687f654): the dq/dk kernel's key-tile pair as one [128, E
    # step] v tile and one [64, 128] dp product per E step, split after the reduction -- 3.916 vs 3.935 ms fwd+bwd at
    # 4k (the same backward within noise; with 8 warps 4.49); the kernel is not bound by its MMA shape
    # The slab path (lintime.ops.gau.triton.slab; session 10): scores materialised per slab of R rows, the
    # E-wide products as cuBLAS GEMMs.  "tiled" is the FlashAttention-shaped kernels above.
    # H200 (2026-11-26, CUDA-graph fwd+bwd at 2k / 4k / 8k, ms): tiled 2.01 / 3.60 / 6.78; 512-row slabs with
    # [64, 64] score tiles and 4 warps 1.17 / 2.06 / 3.97 (the default since); [128, 128] tiles with 8 warps: slabs
    # of 256 rows 1.30 / 2.45 / 4.77, 512 1.25 / 2.23 / 4.25, 1024 1.29 / 2.22 / 4.01; with 4 warps (512) 1.42 /
    # 2.56 / 4.95
    # 2026-11-26, fixed slab heights at 1k..32k: plan.slab_rows (512 up to 4k, 1024 up to 16k, 2048 beyond: the
    # default since); 8 warps (512 rows) 0.751 / 1.234 / 2.185 / 4.141 / 8.434 / 17.04 ms vs 4 warps 0.693 / 1.131 /
    # 2.027 / 3.859 / 7.862 / 15.71, 2 warps 0.782 / 1.294 / 2.298 / 4.420 / 8.853 / 18.29
    ("tiled", {"slab": 0}),
    ("slab512_bm128_w8", {"slab": 512, "bm_slab": 128, "warps_slab": 8, "slab_max": 0}),
    ("slab256", {"slab": 256, "slab_max": 0}),
    ("slab512", {"slab": 512, "slab_max": 0}),
    ("slab1024", {"slab": 1024, "slab_max": 0}),
    ("slab2048", {"slab": 2048, "slab_max": 0}),
    ("slab_w8", {"warps_slab": 8}),
    ("slab_w2", {"warps_slab": 2}),
    # packed calls: runs of equal-length sequences by slabs (slab.slab_runs; eager fwd+bwd at 32k tokens, rows of
    # 1k / 2k / 4k / 8k with three in four whole documents: 14.6 / 10.0 / 9.2 / 9.6 ms against the tiled default's
    # 2.8 / 3.7 / 5.8 / 8.2 -- short runs are separate slab batches of ~6 launches per slab)
    ("slab_packed", {"slab_packed": 1}),
    # Measured and removed (code in commit ead069c; H200 2026-11-26, CUDA-graph fwd+bwd at 2k / 4k / 8k / 32k against
    # the default's 1.120 / 2.078 / 3.833 / 14.15 ms): two or four key tiles per program of the forward score kernel
    # (one q load) 1.167 / 2.046 / 3.803 / 14.05 and 1.161 / 2.048 / 3.816 / 14.69 -- noise; the bias gradient summed
    # along each tile's diagonals through a per-program scratch (one atomic per diagonal, not per score) 1.271 /
    # 2.279 / 4.111 / 15.22 -- slower: two barriers and the scratch's traffic per tile cost more than the atomics
)


def _plan(B, T, cu_seqlens, bm, device, packed: dict | None = None):
    """Regions = non-empty sequences (of a packed call, those its split left to the tiled kernels: ``packed``, the
    call's :func:`_packed` entry, which keeps the tables); returns the device tables and the longest sequence.
    Unpacked calls reuse the tables of the same shape (no host work, no copy)."""
    if cu_seqlens is None:
        return _regular_plan(B, T, bm, str(device))
    if "plan" not in packed:
        packed["plan"] = _build_plan(*packed["bounds"], bm, device)
    return packed["plan"]


@functools.lru_cache(maxsize=64)
def _regular_plan(B, T, bm, device):
    return _build_plan(*sequence_bounds(B, T, None), bm, torch.device(device))


def _packed(B, T, cu_seqlens, cfg: Blocks, S: int, causal: bool, device) -> dict:
    """A packed call's plan, kept per ``cu_seqlens`` tensor (:func:`lintime.ops.utils.packed_cache`: a model's other
    layers and backward passes skip the host read of ``cu_seqlens`` and the rebuild): ``runs`` (slab runs,
    :func:`~.slab.slab_runs`), ``bounds`` (the sequences left to the tiled kernels), ``mask`` (the rows for the masked
    slab path, :func:`~.slab.packed_rows`, unless the call is one run) and, once built, the tiled kernels' ``plan``."""
    entry = packed_cache(cu_seqlens, ("gau", B, T, cfg, S, causal, str(device)))
    if not entry:
        starts, lengths = sequence_bounds(B, T, cu_seqlens)
        runs, rest = slab_runs(starts, lengths, cfg, S)
        bounds = (starts[rest], lengths[rest])
        mask = None if _one_run(runs, bounds) else packed_rows(starts, lengths, B * T, T, cfg, S, causal, cu_seqlens,
                                                                device)
        entry.update(runs=runs, bounds=bounds, mask=mask)
    return entry


def _whole_slab(packed: dict, T: int, *xs):
    """``(L, views of xs, mask)`` when the slab path takes a packed call whole -- one length (``[n, L]`` views of its
    run) or rows of mixed sequences (``[N / L, L]`` views, pairs across sequences masked) --, else None."""
    runs, bounds, mask = packed["runs"], packed["bounds"], packed["mask"]
    if _one_run(runs, bounds):
        s0, n, L = runs[0]
        return L, _run_views(T, s0, n, L, *xs), None
    if mask is not None:
        return mask.L, _run_views(T, 0, T // mask.L, mask.L, *xs), mask
    return None


def _one_run(runs, bounds) -> bool:
    """Whether a packed call is all one run (every non-empty sequence of one length): an ``[n, L]`` call."""
    return len(runs) == 1 and not bool((bounds[1] > 0).any())


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
    # heavy tiles first (Blocks.gau_order, causal calls): a query tile's work grows with its offset, a
    # key tile's with the tokens after it; programs start roughly in grid order, so the longest ones
    # no longer make the tail of the launch
    qo = torch.argsort(off, descending=True, stable=True)
    ko = torch.argsort(lengths[reg] - off, descending=True, stable=True)
    tables = to_device(device, reg, off, starts, lengths, reg[qo], off[qo], reg[ko], off[ko])
    return tables, reg.numel(), longest


def _tile_tables(tables, cfg: Blocks, causal: bool, side: str, bwd: bool):
    """``(TILE_REG, TILE_OFF)`` in the order the kernels' programs take them: natural, or with the
    ``gau_order`` bit of the pass (bit 0 forward, bit 1 backward) and causal attention heaviest
    first (``side`` 'q': query tiles, 'k': key tiles)."""
    if (cfg.gau_order >> int(bwd)) & 1 and causal:
        return tables[4:6] if side == "q" else tables[6:8]
    return tables[0:2]


def _fwd_fake(q, k, v, rel_bias, cu_seqlens, scale, causal, blocks):
    return torch.empty_like(v)


def _gau_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, causal: bool, blocks: list[int],
) -> torch.Tensor:
    return _fwd_impl(q, k, v, rel_bias, cu_seqlens, scale, causal, blocks_of(blocks))


def _tma(cfg: Blocks, S: int, E: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels load whole tiles through TMA descriptors (``Blocks.tma``, a TMA device,
    16-bit inputs, ``S`` one whole step, ``E`` a multiple of every ``E`` tile).  fp32 inputs keep the
    pointer loads on a GPU: the TMA pipeline's buffers for 512-wide fp32 tiles exceed the shared memory
    (H200); the interpreter, which has no such limit, takes the TMA path in fp32 too, so the CPU tests
    check it exactly."""
    return bool(cfg.tma and tma_device(device) and (dtype.itemsize == 2 or interpreting()) and S == cfg.bs_gau
                and E % cfg.be_fwd == 0 and E % cfg.be_dv == 0 and E % cfg.be_red_gau == 0)


def _loads(tma: bool, specs: tuple, tiles: torch.Tensor | None, cfg: Blocks) -> tuple[tuple, bool, bool]:
    """A kernel's load arguments ``(DQ_, DK_, ..., DB_)``, ``TMA`` and ``TMA_BIAS``: with ``tma`` the TMA
    descriptors of ``specs`` (``(tensor, rows, block)``) and, with a bias and ``Blocks.tma_bias``, of its tiles
    (``[H NTD bm, bm]``, ``[bm, bm]`` blocks); else the plain tensors.  ``DB_`` is a placeholder where the kernels
    read the tiles by pointers (no descriptor, or an unaligned tensor: the pointer path)."""
    plain = tuple(t for t, _, _ in specs)
    bias_tma = tiles is not None and bool(cfg.tma_bias)
    extra = ((tiles, tiles.shape[0] * tiles.shape[1] * cfg.bm, (cfg.bm, cfg.bm)),) if bias_tma else ()
    d = tma_descriptors(*specs, *extra) if tma else None
    if d is None:
        return (*plain, plain[0]), False, False
    return ((*d,) if bias_tma else (*d, plain[0])), True, bias_tma


def _fwd_impl(q, k, v, rel_bias, cu_seqlens, scale, causal, cfg: Blocks):
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
    runs = packed["runs"] if packed is not None else []
    for s0, n, L in runs:  # packed (slab_packed): runs of equal-length sequences by slabs, the rest tiled below
        qr, kr, vr, orun = _run_views(T, s0, n, L, q, k, v, o)
        slab_fwd(qr, kr, vr, _run_bias(rel_bias, T, L), scale, causal, cfg, o=orun)
    tables, NT, longest = _plan(B, T, cu_seqlens, cfg.bm, q.device, packed)
    if NT == 0:
        return o
    t_reg, t_off = _tile_tables(tables, cfg, causal, "q", bwd=False)
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
        BM=cfg.bm, BS=cfg.bs_gau, BE=cfg.be_fwd, CAUSAL=causal, HAS_BIAS=bias is not None,
        ONE_S=cfg.bs_gau >= S, PREC=dot_config(q.dtype)[1], TMA=tma, TMA_BIAS=tma_bias, num_warps=cfg.warps_gau_fwd,
        num_stages=cfg.stages_gau_fwd or cfg.stages_gau,
    )
    return o


def _bwd_fake(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, blocks):
    db = rel_bias.new_empty(rel_bias.shape) if (need_db and rel_bias is not None) else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db


def _gau_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, causal: bool, need_db: bool, blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (input dtype) and ``db`` (``[H, 2T-1]`` in ``rel_bias``'s dtype, or
    an empty tensor when not asked for)."""
    return _bwd_impl(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, blocks_of(blocks))


gau_bwd = custom_op("gau_bwd", _bwd_fake)(_gau_bwd)


def _bwd_impl(do, q, k, v, rel_bias, cu_seqlens, scale, causal, need_db, cfg: Blocks):
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
    run_dk, run_db = [], []
    runs = packed["runs"] if packed is not None else []
    for s0, n, L in runs:  # packed (slab_packed): runs of equal-length sequences by slabs (dq, dv in place)
        qr, kr, vr, dor, dqr, dvr = _run_views(T, s0, n, L, q, k, v, do, dq32, dv)
        _, dkr, _, dbr = slab_bwd(dor, qr, kr, vr, _run_bias(rel_bias, T, L), scale, causal, need_db, cfg,
                                  dq32=dqr, dv=dvr, db_dtype=torch.float32)
        run_dk.append((s0, n * L, dkr))
        run_db.append((L, dbr))
    tables, NT, longest = _plan(B, T, cu_seqlens, cfg.bm, q.device, packed)
    r_start, r_len = tables[2:4]
    ntd = 2 * cdiv(max(longest, 1), cfg.bm) - 1
    # (no bias gradient: a 1-element placeholder the kernel never touches, not a fill)
    db_tiles = (torch.zeros((H, ntd, cfg.bm, cfg.bm), dtype=torch.float32, device=q.device) if need_db
                else torch.empty(1, dtype=torch.float32, device=q.device))
    if NT > 0:
        common = {"CAUSAL": causal, "HAS_BIAS": bias is not None, "ONE_S": cfg.bs_gau >= S,
                  "PREC": dot_config(q.dtype)[1], "num_stages": cfg.stages_gau}
        tiles = bias_tiles(bias, ntd, T - 1, cfg.bm)
        b_ptr = tiles if tiles is not None else q
        R, tma = B * T, _tma(cfg, S, E, q.device, q.dtype)
        loads, on, on_bias = _loads(tma, ((q, R, (cfg.bm, S)), (k, R, (cfg.bm, S)), (do, R, (cfg.bm, cfg.be_dv))),
                                    tiles, cfg)
        relu2_bwd_dv_kernel[(cdiv(E, cfg.be_dv), NT, H)](
            q, k, do, dv, b_ptr, *loads,
            *_tile_tables(tables, cfg, causal, "k", bwd=True), r_start, r_len,
            float(scale), S, E, H, ntd,
            BM=cfg.bm, BS=cfg.bs_gau, BE=cfg.be_dv, TMA=on, TMA_BIAS=on_bias, num_warps=cfg.warps_gau_dv, **common,
        )
        loads, on, on_bias = _loads(tma, ((q, R, (cfg.bm, S)), (k, R, (cfg.bm, S)), (v, R, (cfg.bm, cfg.be_red_gau)),
                                          (do, R, (cfg.bm, cfg.be_red_gau))), tiles, cfg)
        relu2_bwd_dqk_kernel[(NT, H)](
            q, k, v, do, dq32, dk32, db_tiles, b_ptr, *loads,
            *_tile_tables(tables, cfg, causal, "q", bwd=True), r_start, r_len,
            float(scale), S, E, H, ntd,
            BM=cfg.bm, BS=cfg.bs_gau, BE=cfg.be_red_gau, NEED_DB=need_db, TMA=on, TMA_BIAS=on_bias,
            num_warps=cfg.warps_gau, **common,
        )
    elif not runs:
        dv.zero_()
    db = q.new_empty(0)
    if need_db:
        db = fold_bias_grad(db_tiles, LB, T - 1, cfg.bm, torch.float32 if runs else rel_bias.dtype)
        for L, dbr in run_db:  # the runs' bias gradients, summed in fp32
            _run_bias(db, T, L).add_(dbr)
        db = db.to(rel_bias.dtype)
    dk = dk32.to(k.dtype)
    for s0, nL, dkr in run_dk:
        dk[0, s0:s0 + nL].copy_(dkr.reshape(nL, *dk.shape[2:]))
    return dq32.to(q.dtype), dk, dv, db


def _setup(ctx, inputs, output):
    q, k, v, rel_bias, cu_seqlens, scale, causal, blocks = inputs
    ctx.save_for_backward(q, k, v, rel_bias, cu_seqlens)
    ctx.scale, ctx.causal, ctx.blocks = scale, causal, blocks


def _backward(ctx, do, eager=False):
    """Backward of ``lintime::gau_fwd`` (through ``lintime::gau_bwd``, which ``torch.compile`` and
    opcheck trace) and of the eager Function (``eager``: the launcher itself)."""
    q, k, v, rel_bias, cu_seqlens = ctx.saved_tensors
    need_db = rel_bias is not None and ctx.needs_input_grad[3]
    if not eager:
        dq, dk, dv, db = gau_bwd(do, q, k, v, rel_bias, cu_seqlens, ctx.scale, ctx.causal, need_db, ctx.blocks)
    else:  # skip the op dispatch
        dq, dk, dv, db = _bwd_impl(do, q, k, v, rel_bias, cu_seqlens, ctx.scale, ctx.causal, need_db,
                                   blocks_of(ctx.blocks))
    return dq, dk, dv, (db if need_db else None), None, None, None, None


gau_fwd = custom_op("gau_fwd", _fwd_fake, backward=_backward, setup_context=_setup)(_gau_fwd)


class _EagerGAU(torch.autograd.Function):
    """The same forward / backward as ``lintime::gau_fwd`` for eager calls, without the custom-op
    dispatch; ``torch.compile`` traces the custom op instead (:func:`triton_gau_attention` picks)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_bias, cu_seqlens, scale, causal, blocks):
        o = _fwd_impl(q, k, v, rel_bias, cu_seqlens, scale, causal, blocks)
        _setup(ctx, (q, k, v, rel_bias, cu_seqlens, scale, causal, blocks), o)
        return o

    @staticmethod
    def backward(ctx, do):
        return _backward(ctx, do, eager=True)


def triton_gau_attention(q, k, v, *, causal=True, rel_bias=None, scale, cu_seqlens=None, blocks: Blocks | None = None):
    """Fused GAU attention: same arguments and result as
    :func:`lintime.ops.gau.naive.naive_gau_attention` (q, k ``[B, T, H, S]``, v ``[B, T, H, E]``,
    rel_bias ``[H, 2T - 1]``); fp16 / bf16 / fp32 inputs, fp32 accumulation.  ``blocks``
    overrides the block sizes and the path (:func:`default_blocks`; ``slab = 0`` the tiled kernels, else the
    slab path for unpacked calls with ``S <= 256``).  fp64 inputs go to the chunked PyTorch
    form (Triton's fp64 products are not worth a kernel variant)."""
    if q.dtype == torch.float64:
        from lintime.ops.gau.chunk import chunk_gau_attention

        return chunk_gau_attention(q, k, v, causal=causal, rel_bias=rel_bias, scale=scale, cu_seqlens=cu_seqlens)
    check_device("gau_attention", q)
    S, E = q.shape[-1], v.shape[-1]
    blocks = blocks or default_blocks(S, E, q.dtype)
    q, k, v = (x.contiguous() for x in (q, k, v))
    args = (q, k, v, rel_bias, cu_seqlens, float(scale), bool(causal))
    if torch.compiler.is_compiling():
        return gau_fwd(*args, blocks.to_list())
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, rel_bias)):
        return _EagerGAU.apply(*args, blocks)
    return _fwd_impl(*args, blocks)
