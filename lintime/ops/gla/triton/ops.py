"""Host side of the GLA Triton kernels: launchers, the ``lintime::`` custom ops (forward,
backward, decoding) and the backend entry :func:`triton_gla`.

Kernel sequence (``ns`` = chunks per segment, see :mod:`lintime.ops.segments`):

* forward: ``gla_fwd_prep_kernel`` (per chunk: ``A``, ``q exp G``, ``k exp(G_l - G)``, ``G_l``)
  -> [segment summaries + scan, when materialised] -> ``gla_fwd_kernel`` (output walk, per-chunk
  states, final state);
* backward: [reverse segment summaries of ``scale (q exp G)^T do`` + scan] ->
  ``gla_bwd_dv_kernel`` (backward walk: ``dv``, per-chunk state gradients) ->
  [``gla_bwd_dA_kernel`` (per chunk: ``dA = scale (do v^T)``, masked), opt-in ``cfg["dA_once"]``] ->
  ``gla_bwd_dqkg_kernel`` (per chunk and K-block: ``dq, dk, dg``).
"""

import math
from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from lintime.ops.gla.triton.kernels import (
    gla_bwd_dA_kernel,
    gla_bwd_dqkg_kernel,
    gla_bwd_dv_kernel,
    gla_fwd_kernel,
    gla_fwd_prep_kernel,
    gla_recurrent_kernel,
    gla_seg_summary_kernel,
)
from lintime.ops.custom_op import custom_op, empty_f32, none_if_empty
from lintime.ops.gla.triton.subchunk import BC
from lintime.ops.kernel_launch import check_device, dot_config, flat, supported
from lintime.ops.segments import BT, choose_segment_chunks, chunks, seg_alloc_rows, segments
from lintime.ops.state_passing import seg_scan_kernel

DECODE_MAX_T = 16  # forward-only calls up to this many tokens use the recurrent kernel
TILE = 8192  # fp32 elements of the [all K, BV] state tile of the output / dv walks (32 KB; 64 KB at K = 128)
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _cdiv(a: int, b: int) -> int:
    # host-side ceil division (triton.cdiv / next_power_of_2 cost ~10 us a call in Triton 3.9, where
    # they are constexpr functions; an eager fwd+bwd made a dozen of them)
    return -(-a // b)


def _block(d: int) -> int:
    """``kernel_launch.block`` in plain Python (a power of two >= 16)."""
    return max(16, 1 << (max(d, 1) - 1).bit_length())


def _tiles(K: int, V: int):
    """``[all K, BV]`` tiles for the output / dv walks; ``(BK, BV)`` of the dq/dk/dg kernel (a K-block
    per program, V walked in blocks).  K-blocks of 32 with 8 warps: they spill 620 B on sm_90a at
    K = 128, V = 256 (16 compile without spills, 231 registers; 64 spill 1460 B) but recompute
    ``do v^T`` half as often -- measured faster on an H200 (2026-11-22).  At K = 128 the walks take
    ``[128, 128]`` tiles (238 registers, no spills on sm_90a; with two pipeline stages 2.47 -> 2.22 ms
    fwd+bwd at 8k against ``[128, 64]`` and one stage, H200, 2026-11-22)."""
    BKf, BVf = _block(K), _block(V)
    tile = 2 * TILE if BKf == 128 else TILE
    return dict(v_walk=(BKf, min(BVf, max(16, tile // BKf))), dqkg=(min(32, BKf), min(64, BVf)))


def _one_level(cfg: dict, dtype: torch.dtype) -> bool:
    """One-level in-chunk products (one matmul per chunk and K-block where its gates span < 40 nats,
    see :mod:`lintime.ops.gla.triton.kernels`): bf16 inputs unless ``cfg["one_level"]`` says."""
    flag = cfg.get("one_level")
    return dtype == torch.bfloat16 if flag is None else bool(flag)


def _launch(cfg: dict, name, num_warps, num_stages, maxnreg=0):
    """Launch options of kernel ``name``: ``cfg[name] = (num_warps, num_stages)`` and
    ``cfg[name + "_maxnreg"]`` (a register cap per thread; 0 = none) override the defaults."""
    nw, st = cfg.get(name, (num_warps, num_stages))
    out = dict(num_warps=nw, num_stages=st)
    cap = cfg.get(f"{name}_maxnreg", maxnreg)
    if cap:  # 128 per thread: two 8-warp programs per SM
        out["maxnreg"] = cap
    return out


# Candidate launch configurations (``cfg`` of :func:`gla_fwd` / :func:`gla_bwd`): timed by ``lintime
# bench ops --cases linear_gla.gla_configs`` and run against the naive form by the CUDA test
# ``test_launch_variants`` (the tile-shape ones also under the interpreter) -- a variant becomes a default
# only after both, on the GPU.  Defaults (version 4, 2026-11-22): one-level in-chunk products for bf16,
# prep kernel 4 warps and K-blocks of 32, ``[128, 128]`` walk tiles with 2 stages at K = 128, dq/dk/dg
# kernel K-blocks of 32, 8 warps, 2 stages, at most 128 registers per thread with one level (none
# otherwise).  H200, fwd+bwd at 8k through the launchers (ms, docs/notes/kernels_linear_gla.md): version
# 3.1 2.47; with one level 1.48
# ("two_level" 2.26 with the new walks); dq/dk/dg capped at 128 registers 1.31; ``[128, 64]`` walks 1.59,
# one-stage walks 1.59, both (3.1's walks) 1.73; "dA_once_dqkg64" 1.33 and "dqkg_s3" 1.39 (both
# uncapped), "dqkg16" 1.86, "prep_w8" 1.56.  4-warp dq/dk/dg programs gave a wrong dq and illegal
# addresses in the CUDA tests (H200, Triton 3.6, version 3.1): not offered.  "dA_once*": the score
# gradient ``dA = scale (do v^T)`` (masked, fp32 ``[TT, H, BT]``) written once per chunk by
# ``gla_bwd_dA_kernel`` and read by every K-block program of the dq/dk/dg kernel.
LAUNCH_VARIANTS = (
    ("default", None),
    ("two_level", {"one_level": False}),  # secondary tiling everywhere (bf16's path before version 4; fp16 / fp32)
    ("two_level_cap", {"one_level": False, "dqkg_maxnreg": 128}),
    ("one_level", {"one_level": True}),  # the one-level path for every dtype (= default for bf16)
    ("dqkg_nocap", {"dqkg_maxnreg": 0}),  # the dq/dk/dg kernel without its register cap (before version 4)
    ("dqkg_s3", {"dqkg": (8, 3)}),
    ("dqkg_s3_nocap", {"dqkg": (8, 3), "dqkg_maxnreg": 0}),
    ("dA_once", {"dA_once": True}),
    ("dA_once_dqkg64", {"dA_once": True, "dqkg_tile": (64, 64)}),
    ("dA_once_dqkg64_nocap", {"dA_once": True, "dqkg_tile": (64, 64), "dqkg_maxnreg": 0}),
    ("dA_once_dqkg16", {"dA_once": True, "dqkg_tile": (16, 64)}),
    ("dqkg16", {"dqkg_tile": (16, 64)}),
    ("walk_bv64", {"v_walk": (128, 64)}),
    ("walk_bv64_s1", {"v_walk": (128, 64), "fwd": (8, 1), "dv": (8, 1)}),  # the walks of version 3.1
    ("walk_s1", {"fwd": (8, 1), "dv": (8, 1)}),
    ("prep_bk64", {"A_bk": 64}),
    ("prep_w8", {"A": (8, 1)}),
)
TILE_KEYS = ("v_walk", "dqkg_tile", "A_bk", "dA_once", "one_level")  # the cfg keys that change what a kernel computes per program
LAUNCH_NAMES = ("A", "fwd", "dv", "dqkg", "dA")  # cfg[name] = (num_warps, num_stages), cfg[name + "_maxnreg"]
CFG_KEYS = frozenset((*TILE_KEYS, "dA_bv", *LAUNCH_NAMES, *(f"{n}_maxnreg" for n in LAUNCH_NAMES)))  # all the launchers read


def _walk_stages(bk: int) -> int:
    """Pipeline stages of the output / dv walks: 2 up to 128-wide keys (CUDA-tested; 2.22 vs 2.47 ms at
    K = 128 with ``[128, 128]`` tiles), 1 for wider keys (their ``[256, BV]`` tiles were never compiled
    with 2 stages on a GPU: shared memory)."""
    return 2 if bk <= 128 else 1


def _warps(bk: int, bv: int) -> int:
    # 8 warps keep the [64, K] tiles of a chunk out of local memory; Triton 3.6 on Hopper was
    # also seen to fault (illegal address) with 4 warps on the K = 128, V = 256 tiles
    return 8 if bk * bv >= 2048 else 4


def _n_seq(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-chunk states and state gradients in HBM: bf16 for bf16 inputs (the matmuls that read
    them run in bf16 anyway), fp32 otherwise (fp16's range is too small for a state)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _chunk_rows(B: int, T: int, N: int, varlen: bool) -> int:
    """Rows of per-chunk tensors, from shapes alone (a bound with ``cu_seqlens``)."""
    return seg_alloc_rows(B, T, N, varlen, 1)


def _segment_states(x, y, gl, seg, *, H, reverse=False, alpha=1.0, init=None):
    """States entering each segment (``[NSEG_ALLOC, H, K, V]`` fp32) and after each sequence
    (``[N, H, K, V]``) from the gated inputs ``x [TT, H, K]``, ``y [TT, H, V]`` and the per-chunk
    log-decays ``gl`` (:func:`gla_seg_summary_kernel`, then ``seg_scan_kernel``)."""
    K, V = x.shape[-1], y.shape[-1]
    f32 = dict(dtype=torch.float32, device=x.device)
    _, PREC = dot_config(x.dtype)
    delta = torch.empty(max(seg.NSEG, 1), H, K, V, **f32)
    gsum = torch.empty(max(seg.NSEG, 1), H, K, **f32)
    la = seg.kernel_args()
    BK, BV = min(64, _block(K)), min(64, _block(V))
    if seg.NSEG > 0:
        gla_seg_summary_kernel[(_cdiv(K, BK) * _cdiv(V, BV) * seg.NSEG, H)](
            x, y, gl, delta, gsum, float(alpha), **la, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, REVERSE=reverse,
            PREC=PREC, num_warps=4,
        )
    start = torch.empty(seg.NSEG_ALLOC, H, K, V, **f32)
    final = torch.empty(seg.N, H, K, V, **f32)
    if seg.N > 0:
        SK, SV = min(32, _block(K)), min(32, _block(V))
        seg_scan_kernel[(_cdiv(K, SK) * _cdiv(V, SV), seg.N, H)](
            delta, delta, gsum, init, None, start, None, final, None, seg.seq_ptr, seg.NSPS,
            H=H, K=K, V=V, BK=SK, BV=SV, VARLEN=seg.varlen, USE_G=True, REVERSE=reverse, NORM=False,
            HAS_INIT=init is not None, STORE_START=True, num_warps=2,
        )
    return start, final


# --------------------------------------------------------------------------------------------
# forward


def _fwd_fake(q, k, v, g, h0, cu_seqlens, scale, ns, keep=True):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _n_seq(q, cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    rows = _chunk_rows(B, T, N, cu_seqlens is not None)
    return (
        q.new_empty(B, T, H, V),
        q.new_empty(N, H, K, V, **f32),
        q.new_empty(B, T, H, BT, **f32),
        q.new_empty(B * T, H, K),
        q.new_empty(B * T, H, K),
        q.new_empty(rows, H, K, **f32),
        q.new_empty(rows if keep else 0, H, K, V, dtype=_state_dtype(q.dtype)),
    )


def gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, keep=True, cfg=None):
    """Forward launcher (``cfg``: ``{kernel: (num_warps, num_stages)}`` overrides, ``"A_bk"``: K-block of
    the prep kernel, ``"v_walk"``: ``(BK, BV)`` of the walks; benchmarks only):
    ``o, ht, A, qg, kg, gl, hc`` -- output, final state, and for the backward the in-chunk scores,
    the gated inputs ``q exp G``, ``k exp(G_l - G)`` (``[TT, H, K]``), the per-chunk log-decays
    (``[NCH, H, K]`` fp32) and the state entering each chunk (``[NCH, H, K, V]``; empty unless
    ``keep``: forward-only calls skip writing it)."""
    cfg = cfg or {}
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _n_seq(q, cu_seqlens)
    seg = segments(B, T, cu_seqlens, ns, q.device)
    qf, kf, vf, gf = flat(q), flat(k), flat(v), flat(g)
    SDT, PREC = dot_config(q.dtype)
    DT = _TL[q.dtype]
    f32 = dict(dtype=torch.float32, device=q.device)
    rows = _chunk_rows(B, T, N, cu_seqlens is not None)
    A = torch.empty(B * T, H, BT, **f32)
    qg, kg = torch.empty_like(qf), torch.empty_like(kf)
    gl = torch.empty(rows, H, K, **f32)
    hc = torch.empty(rows if keep else 0, H, K, V, dtype=_state_dtype(q.dtype), device=q.device)
    ch = seg if seg.ns == 1 else chunks(B, T, cu_seqlens, q.device)
    if ch.NSEG > 0:
        BK = min(cfg.get("A_bk", 32), _block(K))  # 64 spills at K = 128 (sm_90a ptxas)
        gla_fwd_prep_kernel[(ch.NSEG, H)](
            qf, kf, gf, A, qg, kg, gl, scale, **ch.kernel_args(), H=H, K=K, BT=BT, BC=BC, BK=BK, DT=DT, PREC=PREC,
            ONE_LEVEL=_one_level(cfg, q.dtype), **_launch(cfg, "A", 4, 1),  # 4 warps: 0.74 -> 0.44 ms at 8k (H200, 2026-11-22)
        )
    if seg.materialized:
        hs, ht = _segment_states(kg, vf, gl, seg, H=H, init=h0)
    else:
        hs, ht = empty_f32(q), torch.empty(seg.N, H, K, V, **f32)
    o = torch.empty(B * T, H, V, dtype=q.dtype, device=q.device)
    BK, BV = cfg.get("v_walk", _tiles(K, V)["v_walk"])
    if seg.NSEG > 0:
        gla_fwd_kernel[(_cdiv(V, BV) * seg.NSEG, H)](
            qg, kg, vf, gl, A, o, h0, hs, ht, hc, scale, **seg.kernel_args(), H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            HAS_H0=h0 is not None, MAT=seg.materialized, STORE_HC=keep, DT=DT, SDT=SDT, PREC=PREC,
            **_launch(cfg, "fwd", _warps(BK, BV), _walk_stages(BK)),
        )
    return o.view(B, T, H, V), ht, A.view(B, T, H, BT), qg, kg, gl, hc


# --------------------------------------------------------------------------------------------
# backward


def _bwd_fake(q, k, v, g, A, qg, kg, gl, hc, do, dht, cu_seqlens, scale, ns, need_dh0):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _n_seq(q, cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            q.new_empty(N, H, K, V, **f32) if need_dh0 else q.new_empty(0, **f32))


def gla_bwd(q, k, v, g, A, qg, kg, gl, hc, do, dht, cu_seqlens, scale, ns, need_dh0, cfg=None):
    """Backward launcher: ``dq, dk, dv, dg, dh0`` (``dh0`` empty unless ``need_dh0``); ``A, qg, kg,
    gl, hc`` from :func:`gla_fwd`.  ``cfg`` (benchmarks only): ``{kernel: (num_warps, num_stages)}``
    overrides, ``"v_walk"``: ``(BK, BV)`` of the dv walk, ``"dqkg_tile"``: ``(BK, BV)`` of the dq/dk/dg
    kernel, ``"dA_once"``: compute ``dA = scale (do v^T)`` once per chunk (``gla_bwd_dA_kernel``, V-blocks
    of ``"dA_bv"``, default 64; fp32 ``[TT, H, BT]``, 16 KB per chunk and head) instead of once per K-block."""
    cfg = cfg or {}
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _n_seq(q, cu_seqlens)
    seg = segments(B, T, cu_seqlens, ns, q.device)
    qf, kf, vf, gf, dof = flat(q), flat(k), flat(v), flat(g), flat(do)
    Af = A.view(B * T, H, BT)
    SDT, PREC = dot_config(q.dtype)
    DT = _TL[q.dtype]
    f32 = dict(dtype=torch.float32, device=q.device)
    ds = None
    if seg.materialized:
        ds, dh0 = _segment_states(qg, dof, gl, seg, H=H, reverse=True, alpha=scale, init=dht)
    else:
        dh0 = torch.empty(seg.N, H, K, V, **f32) if need_dh0 else empty_f32(q)
    dhs = torch.empty(_chunk_rows(B, T, N, cu_seqlens is not None), H, K, V, dtype=_state_dtype(q.dtype),
                      device=q.device)
    dq, dk, dv, dg = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf), torch.empty_like(gf)
    tiles = _tiles(K, V)
    if seg.NSEG > 0:
        BK, BV = cfg.get("v_walk", tiles["v_walk"])
        gla_bwd_dv_kernel[(_cdiv(V, BV) * seg.NSEG, H)](
            qg, kg, gl, Af, dof, dv, dht, dh0, ds, dhs, scale, **seg.kernel_args(), H=H, K=K, V=V, BT=BT, BK=BK,
            BV=BV, HAS_DHT=dht is not None, MAT=seg.materialized, STORE_DH0=need_dh0 and not seg.materialized,
            DT=DT, SDT=SDT, PREC=PREC, **_launch(cfg, "dv", _warps(BK, BV), _walk_stages(BK)),
        )
    ch = seg if seg.ns == 1 else chunks(B, T, cu_seqlens, q.device)
    if ch.NSEG > 0:
        BK, BV = cfg.get("dqkg_tile", tiles["dqkg"])
        dA = chunk_dA(vf, dof, ch, scale, cfg) if cfg.get("dA_once") else None
        one_level = _one_level(cfg, q.dtype)
        # 8 warps (4 gave wrong dq and illegal addresses in the CUDA tests, H200, Triton 3.6, 2026-11-22)
        gla_bwd_dqkg_kernel[(_cdiv(K, BK) * ch.NSEG, H)](
            qf, kf, vf, gf, dof, hc, dhs, dA, dq, dk, dg, scale, **ch.kernel_args(), H=H, K=K, V=V, BT=BT, BC=BC,
            BK=BK, BV=BV, LOAD_DA=dA is not None, DT=DT, SDT=SDT, PREC=PREC, ONE_LEVEL=one_level,
            # 128 registers (two 8-warp programs per SM): 1.47 -> 1.31 ms fwd+bwd at 8k with one level; the
            # secondary tiling spills under the cap (2.26 -> 2.81 ms, bf16 "two_level"), so only one level
            **_launch(cfg, "dqkg", _warps(BT, max(BK, BV)), 2, maxnreg=128 if one_level else 0),
        )
    if not need_dh0:
        dh0 = empty_f32(q)
    return dq.view_as(q), dk.view_as(k), dv.view_as(v), dg.view_as(g), dh0


def chunk_dA(vf: Tensor, dof: Tensor, ch, scale: float, cfg=None) -> Tensor:
    """The causally masked score gradient ``dA = scale * (do v^T)`` of every chunk of the layout ``ch``
    (one segment per chunk), fp32 ``[TT, H, BT]`` like ``A`` (row = token, column = position in its
    chunk; rows of tokens past their sequence's end left unwritten) from flat ``v, do [TT, H, V]``:
    ``gla_bwd_dA_kernel``, V-blocks of ``cfg["dA_bv"]`` (default 64), ``cfg["dA"]`` = ``(num_warps,
    num_stages)`` (default ``(4, 2)``)."""
    cfg = cfg or {}
    TT, H, V = vf.shape
    _, PREC = dot_config(vf.dtype)
    dA = torch.empty(TT, H, BT, dtype=torch.float32, device=vf.device)
    if ch.NSEG > 0:
        gla_bwd_dA_kernel[(ch.NSEG, H)](
            vf, dof, dA, scale, **ch.kernel_args(), H=H, V=V, BT=BT, BV=min(cfg.get("dA_bv", 64), _block(V)),
            DT=_TL[vf.dtype], PREC=PREC, **_launch(cfg, "dA", 4, 2),
        )
    return dA


@custom_op("gla_bwd", fake=_bwd_fake)
def _bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, A: Tensor, qg: Tensor, kg: Tensor, gl: Tensor, hc: Tensor,
            do: Tensor, dht: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, ns: int,
            need_dh0: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return gla_bwd(q, k, v, g, A, qg, kg, gl, hc, do, dht, cu_seqlens, scale, ns, need_dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, h0, cu_seqlens, scale, ns, keep = inputs
    o, ht, A, qg, kg, gl, hc = output
    ctx.save_for_backward(q, k, v, g, cu_seqlens, A, qg, kg, gl, hc)
    ctx.opts = (scale, ns)


def _backward(ctx, do, dht, *_unused):
    q, k, v, g, cu_seqlens, A, qg, kg, gl, hc = ctx.saved_tensors
    scale, ns = ctx.opts
    if hc.numel() == 0 and q.numel() > 0:
        raise RuntimeError("lintime::gla_fwd ran with keep=False (no per-chunk states kept): no backward")
    do = torch.zeros_like(v) if do is None else do.contiguous()
    bwd = _bwd_op if torch.compiler.is_compiling() else gla_bwd  # eager: skip the op dispatch
    dq, dk, dv, dg, dh0 = bwd(q, k, v, g, A, qg, kg, gl, hc, do, None if dht is None else dht.contiguous(),
                              cu_seqlens, scale, ns, ctx.needs_input_grad[4])
    return dq, dk, dv, dg, none_if_empty(dh0), None, None, None, None


@custom_op("gla_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context)
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
            scale: float, ns: int, keep: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, keep)


class _EagerGLA(torch.autograd.Function):
    """The same forward / backward as ``lintime::gla_fwd`` for eager calls, without the custom-op
    dispatch (its Python layers cost about 2.5x the host time of the launchers themselves: measured
    with no-op kernels, 2.97 ms against 1.14 ms per fwd+bwd on the 2-core CPU machine).
    ``torch.compile`` traces the custom op instead (:func:`triton_gla` picks)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, cu_seqlens, scale, ns, keep):
        ctx.set_materialize_grads(False)  # unused outputs: None gradients (the kernels skip them)
        out = gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, keep)
        _setup_context(ctx, (q, k, v, g, h0, cu_seqlens, scale, ns, keep), out)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, do, dht):
        return _backward(ctx, do, dht)


# --------------------------------------------------------------------------------------------
# decoding


def _recurrent_fake(q, k, v, g, h0, cu_seqlens, scale):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return q.new_empty(B, T, H, V), q.new_empty(_n_seq(q, cu_seqlens), H, K, V, dtype=torch.float32)


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
               scale: float) -> tuple[Tensor, Tensor]:
    """Decoding launcher (``lintime::gla_recurrent``; eager calls skip the op dispatch)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _n_seq(q, cu_seqlens)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    BK = _block(K)
    BV = min(_block(V), max(16, 4096 // BK))
    if N > 0:
        gla_recurrent_kernel[(_cdiv(V, BV), N, H)](
            flat(q), flat(k), flat(v), flat(g), o, h0, ht, cu_seqlens, scale, T, H=H, K=K, V=V, BK=BK, BV=BV,
            VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None, num_warps=4,
        )
    return o, ht


_recurrent_op = custom_op("gla_recurrent", fake=_recurrent_fake)(_recurrent)


# --------------------------------------------------------------------------------------------
# backend entry


def segment_chunks_for(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """The automatic ``ns`` of a call, from shapes alone (see ``choose_segment_chunks``)."""
    B, T, H, K = q.shape
    BV = _tiles(K, v.shape[-1])["v_walk"][1]
    return choose_segment_chunks(_n_seq(q, cu_seqlens), B * T, T, H * math.ceil(v.shape[-1] / BV), q.device)


def triton_gla(
    q, k, v, g, *, scale=None, chunk_size=64, initial_state=None, output_final_state=False, cu_seqlens=None,
    segment_chunks=None,
):
    """Same arguments and results as :func:`lintime.ops.gated_linear_attention`, computed by the
    Triton kernels (chunks of 64 tokens, sub-chunks of 16, whatever ``chunk_size``).

    fp64 inputs and ``K`` or ``V`` above 256 fall back to the chunked PyTorch form.  Forward-only
    calls of at most 16 tokens (decoding) run the recurrent kernel.  ``segment_chunks`` overrides
    the automatic segment length (``0`` = one segment per sequence; tests, benchmarks).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    if not supported(K, V, dtype=q.dtype) or g.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        from lintime.ops.gla.chunk import chunk_gla

        return chunk_gla(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    check_device("gated_linear_attention", q)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, h0))
    if not grad and T <= DECODE_MAX_T:
        rec = _recurrent_op if compiling else _recurrent
        o, ht = rec(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), h0, cu_seqlens, scale)
    else:
        ns = segment_chunks_for(q, v, cu_seqlens) if segment_chunks is None else int(segment_chunks)
        if compiling:
            o, ht, *_ = _fwd_op(q, k, v, g, h0, cu_seqlens, scale, ns, grad)
        elif grad:
            o, ht = _EagerGLA.apply(q, k, v, g, h0, cu_seqlens, scale, ns, True)
        else:
            o, ht, *_ = gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, False)
    return o, (ht if output_final_state else None)
