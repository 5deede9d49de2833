"""Host side of the GLA Triton kernels: launchers, the ``lintime::`` custom ops (forward,
backward, decoding) and the backend entry :func:`triton_gla`.

Kernel sequence (``ns`` = chunks per segment, see :mod:`lintime.ops.utils.segments`):

* forward: ``gla_fwd_prep_kernel`` (per chunk: ``A``, ``q exp G``, ``k exp(G_l - G)``, ``G_l``)
  -> [segment summaries + scan, when materialised] -> ``gla_fwd_kernel`` (output walk, per-chunk
  states, final state);
* backward: [reverse segment summaries of ``scale (q exp G)^T do`` + scan] ->
  ``gla_bwd_dv_kernel`` (backward walk: ``dv``, per-chunk state gradients) ->
  ``gla_bwd_dqkg_kernel`` (per chunk and K-block: ``dq, dk, dg``).

Tiles, warps and stages: :mod:`lintime.ops.gla.triton.launch`.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton.language as tl
from torch import Tensor

from lintime.ops.utils.launching import empty_f32, grad_as, launcher_op, none_if_empty
from lintime.ops.gla.triton.kernels import (
    gla_bwd_dqkg_kernel,
    gla_bwd_dv_kernel,
    gla_fwd_kernel,
    gla_fwd_prep_kernel,
    gla_recurrent_kernel,
    gla_seg_summary_kernel,
)
from lintime.ops.gla.triton.launch import GLALaunch, default_launch, walk_tile
from lintime.ops.gla.triton.subchunk import BC
from lintime.ops.utils.launching import block, cdiv, check_device, dot_config, flat, supported
from lintime.ops.utils.segments import BT, choose_segment_chunks, chunks, seg_alloc_rows, segments
from lintime.ops.utils.state_passing import seg_scan_kernel
from lintime.ops.utils import is_static, mark_static, num_seqs

DECODE_MAX_T = 16  # forward-only calls up to this many tokens use the recurrent kernel
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


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
    BK, BV = min(64, block(K)), min(64, block(V))
    if seg.NSEG > 0:
        gla_seg_summary_kernel[(cdiv(K, BK) * cdiv(V, BV) * seg.NSEG, H)](
            x, y, gl, delta, gsum, float(alpha), **la, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, REVERSE=reverse,
            PREC=PREC, num_warps=4,
        )
    start = torch.empty(seg.NSEG_ALLOC, H, K, V, **f32)
    final = torch.empty(seg.N, H, K, V, **f32)
    if seg.N > 0:
        SK, SV = min(32, block(K)), min(32, block(V))
        seg_scan_kernel[(cdiv(K, SK) * cdiv(V, SV), seg.N, H)](
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
    N = num_seqs(q.shape[0], cu_seqlens)
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


def gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, keep=True, cfg: GLALaunch | None = None):
    """Forward launcher: ``o, ht, A, qg, kg, gl, hc`` -- output, final state, and for the backward the
    in-chunk scores, the gated inputs ``q exp G``, ``k exp(G_l - G)`` (``[TT, H, K]``), the per-chunk
    log-decays (``[NCH, H, K]`` fp32) and the state entering each chunk (``[NCH, H, K, V]``; empty
    unless ``keep``: forward-only calls skip writing it).  ``cfg`` defaults to :func:`~.launch.default_launch`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = cfg or default_launch(K, V, q.dtype)
    N = num_seqs(q.shape[0], cu_seqlens)
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
        gla_fwd_prep_kernel[(ch.NSEG, H)](
            qf, kf, gf, A, qg, kg, gl, scale, **ch.kernel_args(), H=H, K=K, BT=BT, BC=BC, BK=cfg.prep_bk, DT=DT,
            PREC=PREC, ONE_LEVEL=cfg.one_level, **cfg.prep_launch(),
        )
    if seg.materialized:
        hs, ht = _segment_states(kg, vf, gl, seg, H=H, init=h0)
    else:
        hs, ht = empty_f32(q), torch.empty(seg.N, H, K, V, **f32)
    o = torch.empty(B * T, H, V, dtype=q.dtype, device=q.device)
    BK, BV = cfg.walk
    if seg.NSEG > 0:
        gla_fwd_kernel[(cdiv(V, BV) * seg.NSEG, H)](
            qg, kg, vf, gl, A, o, h0, hs, ht, hc, scale, **seg.kernel_args(), H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            HAS_H0=h0 is not None, MAT=seg.materialized, STORE_HC=keep, DT=DT, SDT=SDT, PREC=PREC,
            **cfg.walk_launch(),
        )
    return o.view(B, T, H, V), ht, A.view(B, T, H, BT), qg, kg, gl, hc


# --------------------------------------------------------------------------------------------
# backward


def _bwd_fake(q, k, v, g, A, qg, kg, gl, hc, do, dht, cu_seqlens, scale, ns, need_dh0):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = num_seqs(q.shape[0], cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            q.new_empty(N, H, K, V, **f32) if need_dh0 else q.new_empty(0, **f32))


def gla_bwd(q, k, v, g, A, qg, kg, gl, hc, do, dht, cu_seqlens, scale, ns, need_dh0, cfg: GLALaunch | None = None):
    """Backward launcher: ``dq, dk, dv, dg, dh0`` (``dh0`` empty unless ``need_dh0``); ``A, qg, kg,
    gl, hc`` from :func:`gla_fwd`.  ``cfg`` defaults to :func:`~.launch.default_launch`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = cfg or default_launch(K, V, q.dtype)
    N = num_seqs(q.shape[0], cu_seqlens)
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
    if seg.NSEG > 0:
        BK, BV = cfg.walk
        gla_bwd_dv_kernel[(cdiv(V, BV) * seg.NSEG, H)](
            qg, kg, gl, Af, dof, dv, dht, dh0, ds, dhs, scale, **seg.kernel_args(), H=H, K=K, V=V, BT=BT, BK=BK,
            BV=BV, HAS_DHT=dht is not None, MAT=seg.materialized, STORE_DH0=need_dh0 and not seg.materialized,
            DT=DT, SDT=SDT, PREC=PREC, **cfg.walk_launch(),
        )
    ch = seg if seg.ns == 1 else chunks(B, T, cu_seqlens, q.device)
    if ch.NSEG > 0:
        BK, BV = cfg.dqkg
        gla_bwd_dqkg_kernel[(cdiv(K, BK) * ch.NSEG, H)](
            qf, kf, vf, gf, dof, hc, dhs, dq, dk, dg, scale, **ch.kernel_args(), H=H, K=K, V=V, BT=BT, BC=BC,
            BK=BK, BV=BV, DT=DT, SDT=SDT, PREC=PREC, ONE_LEVEL=cfg.one_level, **cfg.dqkg_launch(),
        )
    if not need_dh0:
        dh0 = empty_f32(q)
    return dq.view_as(q), dk.view_as(k), dv.view_as(v), dg.view_as(g), dh0


@launcher_op("gla_bwd", fake=_bwd_fake)
def gla_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, A: Tensor, qg: Tensor, kg: Tensor, gl: Tensor,
               hc: Tensor, do: Tensor, dht: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, ns: int,
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
    do = torch.zeros_like(v) if do is None else grad_as(do, q.dtype).contiguous()
    dht = grad_as(dht, torch.float32)
    dq, dk, dv, dg, dh0 = gla_bwd_op.for_ctx(ctx)(
        q, k, v, g, A, qg, kg, gl, hc, do, None if dht is None else dht.contiguous(), cu_seqlens, scale, ns,
        ctx.needs_input_grad[4],
    )
    return dq, dk, dv, dg, none_if_empty(dh0), None, None, None, None


@launcher_op("gla_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context, outputs=2)
def gla_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
               scale: float, ns: int, keep: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``o, ht`` (the op returns the saved tensors of :func:`gla_fwd` too)."""
    return gla_fwd(q, k, v, g, h0, cu_seqlens, scale, ns, keep)


# --------------------------------------------------------------------------------------------
# decoding


def _recurrent_fake(q, k, v, g, h0, cu_seqlens, scale):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return q.new_empty(B, T, H, V), q.new_empty(num_seqs(q.shape[0], cu_seqlens), H, K, V, dtype=torch.float32)


@launcher_op("gla_recurrent", fake=_recurrent_fake)
def gla_recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
                     scale: float) -> tuple[Tensor, Tensor]:
    """Decoding launcher: ``o, ht``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = num_seqs(q.shape[0], cu_seqlens)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    BK = block(K)
    BV = min(block(V), max(16, 4096 // BK))  # 4096 fp32 state elements per program (16 KB)
    if N > 0:
        gla_recurrent_kernel[(cdiv(V, BV), N, H)](
            flat(q), flat(k), flat(v), flat(g), o, h0, ht, cu_seqlens, scale, T, H=H, K=K, V=V, BK=BK, BV=BV,
            VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None, num_warps=4,
        )
    return o, ht


# --------------------------------------------------------------------------------------------
# backend entry


def segment_chunks_for(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """The automatic ``ns`` of a call, from shapes alone (see ``choose_segment_chunks``)."""
    B, T, H, K = q.shape
    BV = walk_tile(K, v.shape[-1])[1]
    return choose_segment_chunks(num_seqs(q.shape[0], cu_seqlens), B * T, T, H * math.ceil(v.shape[-1] / BV), q.device)


MIN_TILE_DIM = 16  # tl.dot's smallest tile side


def triton_gla(
    q, k, v, g, *, scale=None, chunk_size=64, initial_state=None, output_final_state=False, cu_seqlens=None,
    segment_chunks=None,
):
    """Same arguments and results as :func:`lintime.ops.gated_linear_attention`, computed by the
    Triton kernels (chunks of 64 tokens, sub-chunks of 16, whatever ``chunk_size``).

    fp64 inputs, and ``K`` or ``V`` below 16 or above 256, fall back to the chunked PyTorch form; with a static
    ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`, planned on the device, never read on the host) heads
    below 16 are zero-padded to 16 instead.  Forward-only calls of at most 16 tokens (decoding) run the recurrent
    kernel.  ``segment_chunks`` overrides the automatic segment length (``0`` = one segment per sequence; tests,
    benchmarks).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    static = is_static(cu_seqlens)
    # Crash guard, cause unknown: on a GPU the kernels gave an illegal memory access and wrong results with K = 8
    # (gla-tiny at width 64); the interpreter, which does not fault on masked-out addresses, does not reproduce it.
    # So heads narrower than a 16-wide tile (MIN_TILE_DIM) never reach the kernels: they take the chunked form, or,
    # with a static cu_seqlens (which cannot take it: it plans packing on the host), are zero-padded to 16
    # (_padded_heads).  Open: docs/design/kernels.md (gated linear attention); reproducer (CUDA, in a subprocess):
    # tests/ops/gla/test_gla_narrow_heads.py.
    narrow = min(K, V) < MIN_TILE_DIM
    if (not supported(K, V, dtype=q.dtype) or (narrow and not static)
            or g.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
        from lintime.ops.gla.chunk import chunk_gla

        return chunk_gla(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    check_device("gated_linear_attention", q)
    if narrow:
        return _padded_heads(q, k, v, g, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             segment_chunks=segment_chunks)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if static and not is_static(cu_seqlens):  # a converted copy: still never read on the host
            cu_seqlens = mark_static(cu_seqlens)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, h0))
    if not grad and T <= DECODE_MAX_T:
        o, ht = gla_recurrent_op(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), h0, cu_seqlens,
                                 scale)
    else:
        ns = segment_chunks_for(q, v, cu_seqlens) if segment_chunks is None else int(segment_chunks)
        o, ht = gla_fwd_op(q, k, v, g, h0, cu_seqlens, scale, ns, grad)  # keep per-chunk states for a backward
    return o, (ht if output_final_state else None)


def _padded_heads(q, k, v, g, *, scale, initial_state, output_final_state, cu_seqlens, segment_chunks):
    """:func:`triton_gla` on heads zero-padded to ``K, V >= 16`` (the smallest ``tl.dot`` tile), results cut back:
    zero ``q, k`` features add nothing to any score, a zero gate keeps their (zero) state rows as they are, zero ``v``
    features give zero outputs; the padding's gradients are cut away by ``F.pad``'s backward."""
    K, V = q.shape[-1], v.shape[-1]
    pk, pv = max(0, MIN_TILE_DIM - K), max(0, MIN_TILE_DIM - V)
    q, k, g = (F.pad(x, (0, pk)) for x in (q, k, g))
    v = F.pad(v, (0, pv))
    h0 = None if initial_state is None else F.pad(initial_state, (0, pv, 0, pk))
    o, ht = triton_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, segment_chunks=segment_chunks)
    return o[..., :V], (None if ht is None else ht[:, :, :K, :V])
