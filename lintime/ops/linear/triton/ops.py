"""Host side of the linear-attention Triton kernels: launchers, the ``lintime::`` custom ops
(forward, backward, decoding) and the backend entry :func:`triton_linear_attention`.

Kernel sequence (``ns`` = chunks per segment, see :mod:`lintime.ops.utils.segments`):

* forward: [segment summaries of ``k^T v`` and ``sum k`` + scan, when materialised or
  non-causal] -> ``linear_fwd_kernel`` (output, normaliser, final state);
* backward: ``linear_bwd_prep_kernel`` (``dd``, normalised only) -> [reverse summaries of
  ``scale q^T do'`` + scan] -> ``linear_bwd_dq_kernel`` (forward walk) and
  ``linear_bwd_dkdv_kernel`` (backward walk; one launch when ``K, V <= 64``, else one for ``dk``
  and one for ``dv``).

Tiles, warps and stages: :mod:`lintime.ops.linear.triton.launch`.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from lintime.ops.linear.triton.kernels import (
    linear_bwd_dkdv_kernel,
    linear_bwd_dq_kernel,
    linear_bwd_prep_kernel,
    linear_fwd_kernel,
    linear_recurrent_kernel,
)
from lintime.ops.utils.launching import (block, cdiv, check_device, dot_config, empty_f32, flat, grad_as, launcher_op,
                                   none_if_empty, supported)
from lintime.ops.linear.triton.launch import LinearLaunch, default_launch, fwd_tile
from lintime.ops.utils.segments import BT, choose_segment_chunks, seg_alloc_rows, segments
from lintime.ops.utils.state_passing import segment_states
from lintime.ops.utils import is_static, mark_static, num_seqs

DECODE_MAX_T = 16  # forward-only calls up to this many tokens use the recurrent kernel


# --------------------------------------------------------------------------------------------
# forward


def _fwd_fake(q, k, v, h0, z0, cu_seqlens, scale, causal, normalize, ns):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = num_seqs(q.shape[0], cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    mat = causal and ns > 0
    rows = seg_alloc_rows(B, T, N, cu_seqlens is not None, ns)
    return (
        q.new_empty(B, T, H, V),
        q.new_empty(N, H, K, V, **f32),
        q.new_empty(N, H, K, **f32) if normalize else q.new_empty(0, **f32),
        q.new_empty(B, T, H, **f32) if normalize else q.new_empty(0, **f32),
        q.new_empty(rows, H, K, V, **f32) if mat else q.new_empty(0, **f32),
        q.new_empty(rows, H, K, **f32) if (mat and normalize) else q.new_empty(0, **f32),
    )


def linear_fwd(q, k, v, h0, z0, cu_seqlens, scale, causal, normalize, ns, cfg: LinearLaunch | None = None):
    """Forward launcher.  Returns ``o, ht, zt, den, hs, zs`` (empty tensors for absent parts):
    final states (non-causal: the sequence totals), the normaliser and the materialised segment
    start states (kept for the backward).  ``cfg`` defaults to :func:`~.launch.default_launch`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = cfg or default_launch(K, V)
    seg = segments(B, T, cu_seqlens, ns, q.device)
    qf, kf, vf = flat(q), flat(k), flat(v)
    SDT, PREC = dot_config(q.dtype)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty(B * T, H, V, dtype=q.dtype, device=q.device)
    den = torch.empty(B * T, H, **f32) if normalize else empty_f32(q)
    hs, zs = empty_f32(q), empty_f32(q)
    if not causal:
        _, _, ht, zt = segment_states(kf, vf, seg, H=H, norm=normalize, store_start=False)
    elif seg.materialized:
        hs, zs, ht, zt = segment_states(kf, vf, seg, H=H, init=h0, init_z=z0, norm=normalize)
    else:
        ht = torch.empty(seg.N, H, K, V, **f32)
        zt = torch.empty(seg.N, H, K, **f32) if normalize else empty_f32(q)
    BK, BV = cfg.fwd
    if seg.NSEG > 0:
        linear_fwd_kernel[(cdiv(V, BV) * seg.NSEG, H)](
            qf, kf, vf, o, den, h0, z0, hs, zs, ht, zt, scale, **seg.kernel_args(),
            H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, CAUSAL=causal, NORM=normalize, HAS_H0=h0 is not None,
            MAT=seg.materialized, SDT=SDT, PREC=PREC, **cfg.launch(),
        )
    if not normalize:
        zt = empty_f32(q)
    o = o.view(B, T, H, V)
    den = den.view(B, T, H) if normalize else den
    if not (causal and seg.materialized):
        hs, zs = empty_f32(q), empty_f32(q)
    return o, ht, zt, den, hs, zs


# --------------------------------------------------------------------------------------------
# backward


def _bwd_fake(q, k, v, o, den, ht, zt, hs, zs, do, dht, dzt, h0, z0, cu_seqlens, scale, causal, normalize, ns,
              need_dh0):
    N, H, K, V = ht.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        q.new_empty(N, H, K, V, **f32) if need_dh0 else q.new_empty(0, **f32),
        q.new_empty(N, H, K, **f32) if (need_dh0 and normalize) else q.new_empty(0, **f32),
    )


def linear_bwd(q, k, v, o, den, ht, zt, hs, zs, do, dht, dzt, h0, z0, cu_seqlens, scale, causal, normalize, ns,
               need_dh0, cfg: LinearLaunch | None = None):
    """Backward launcher: ``dq, dk, dv, dh0, dz0`` (the last two empty unless ``need_dh0``).  ``cfg``
    defaults to :func:`~.launch.default_launch`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cfg = cfg or default_launch(K, V)
    seg = segments(B, T, cu_seqlens, ns, q.device)
    qf, kf, vf, dof = flat(q), flat(k), flat(v), flat(do)
    SDT, PREC = dot_config(q.dtype)
    f32 = dict(dtype=torch.float32, device=q.device)
    TT = B * T
    den_f = den.view(TT, H) if normalize else None
    dd = None
    if normalize and TT > 0:
        dd = torch.empty(TT, H, **f32)
        linear_bwd_prep_kernel[(cdiv(TT, BT), H)](dof, flat(o), den_f, dd, TT, H=H, V=V, BT=BT, BV=block(V),
                                                          num_warps=4)
    dh0, dz0 = empty_f32(q), empty_f32(q)
    ds = dzs = None
    if not causal:
        _, _, ds, dzs = segment_states(qf, dof, seg, H=H, w=dd, rdiv=den_f, reverse=True, alpha=scale, init=dht,
                                       init_z=dzt, norm=normalize, store_start=False)
    elif seg.materialized:
        ds, dzs, dh0, dz0 = segment_states(qf, dof, seg, H=H, w=dd, rdiv=den_f, reverse=True, alpha=scale,
                                           init=dht, init_z=dzt, norm=normalize)
    elif need_dh0:
        dh0 = torch.empty(seg.N, H, K, V, **f32)
        dz0 = torch.empty(seg.N, H, K, **f32) if normalize else empty_f32(q)
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    la = seg.kernel_args()
    common = dict(H=H, K=K, V=V, BT=BT, CAUSAL=causal, NORM=normalize, MAT=seg.materialized, SDT=SDT, PREC=PREC)
    if seg.NSEG > 0:
        BK, BV = cfg.dq
        linear_bwd_dq_kernel[(cdiv(K, BK) * seg.NSEG, H)](
            kf, vf, dof, den_f, dd, dq, h0, z0, hs, zs, ht, zt, scale, **la, BK=BK, BV=BV,
            HAS_H0=h0 is not None, **common, **cfg.launch(),
        )
        store_dh0 = causal and not seg.materialized and need_dh0
        launches = [("fused", True, True)] if cfg.fuse else [("dk", True, False), ("dv", False, True)]
        for name, do_dk, do_dv in launches:
            BK, BV = getattr(cfg, name)
            nblk = 1 if name == "fused" else (cdiv(K, BK) if name == "dk" else cdiv(V, BV))
            linear_bwd_dkdv_kernel[(nblk * seg.NSEG, H)](
                qf, kf, vf, dof, den_f, dd, dk, dv, dht, dzt, dh0, dz0, ds, dzs, scale, **la, BK=BK, BV=BV,
                HAS_DHT=dht is not None, DO_DK=do_dk, DO_DV=do_dv, STORE_DH0=store_dh0, **common,
                **cfg.launch(),
            )
    if not need_dh0:
        dh0, dz0 = empty_f32(q), empty_f32(q)
    if not normalize:
        dz0 = empty_f32(q)
    return dq.view_as(q), dk.view_as(k), dv.view_as(v), dh0, dz0


@launcher_op("linear_attention_bwd", fake=_bwd_fake)
def linear_bwd_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, den: Tensor, ht: Tensor, zt: Tensor, hs: Tensor,
                  zs: Tensor, do: Tensor, dht: Optional[Tensor], dzt: Optional[Tensor], h0: Optional[Tensor],
                  z0: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, causal: bool, normalize: bool,
                  ns: int, need_dh0: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return linear_bwd(q, k, v, o, den, ht, zt, hs, zs, do, dht, dzt, h0, z0, cu_seqlens, scale, causal,
                      normalize, ns, need_dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, h0, z0, cu_seqlens, scale, causal, normalize, ns = inputs
    o, ht, zt, den, hs, zs = output
    ctx.save_for_backward(q, k, v, h0, z0, cu_seqlens, o, den, ht, zt, hs, zs)
    ctx.opts = (scale, causal, normalize, ns)


def _backward(ctx, do, dht, dzt, _dden, _dhs, _dzs):
    q, k, v, h0, z0, cu_seqlens, o, den, ht, zt, hs, zs = ctx.saved_tensors
    scale, causal, normalize, ns = ctx.opts
    do, dht, dzt = grad_as(do, o.dtype), grad_as(dht, ht.dtype), grad_as(dzt, zt.dtype)
    if do is None:
        do = torch.zeros_like(o)
    if normalize and (dht is None) != (dzt is None):  # one part of the final state is unused
        dht = torch.zeros_like(ht) if dht is None else dht
        dzt = torch.zeros_like(zt) if dzt is None else dzt
    need_dh0 = causal and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
    dq, dk, dv, dh0, dz0 = linear_bwd_op.for_ctx(ctx)(
        q, k, v, o, den, ht, zt, hs, zs, do.contiguous(), None if dht is None else dht.contiguous(),
        None if dzt is None else dzt.contiguous(), h0, z0, cu_seqlens, scale, causal, normalize, ns, need_dh0,
    )
    return dq, dk, dv, none_if_empty(dh0), none_if_empty(dz0), None, None, None, None, None


@launcher_op("linear_attention_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context, outputs=3)
def linear_fwd_op(q: Tensor, k: Tensor, v: Tensor, h0: Optional[Tensor], z0: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: float, causal: bool, normalize: bool,
                  ns: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``o, ht, zt`` (the op returns the saved tensors of :func:`linear_fwd` too)."""
    return linear_fwd(q, k, v, h0, z0, cu_seqlens, scale, causal, normalize, ns)


# --------------------------------------------------------------------------------------------
# decoding


def _recurrent_fake(q, k, v, h0, z0, cu_seqlens, scale, normalize):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = num_seqs(q.shape[0], cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    return (q.new_empty(B, T, H, V), q.new_empty(N, H, K, V, **f32),
            q.new_empty(N, H, K, **f32) if normalize else q.new_empty(0, **f32))


@launcher_op("linear_attention_recurrent", fake=_recurrent_fake)
def linear_recurrent_op(q: Tensor, k: Tensor, v: Tensor, h0: Optional[Tensor], z0: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], scale: float, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Decoding launcher: ``o, ht, zt``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = num_seqs(q.shape[0], cu_seqlens)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, **f32)
    zt = torch.empty(N, H, K, **f32) if normalize else empty_f32(q)
    BK = block(K)
    BV = min(block(V), max(16, 8192 // BK))  # 8192 fp32 state elements per program (32 KB)
    if N > 0:
        linear_recurrent_kernel[(cdiv(V, BV), N, H)](
            flat(q), flat(k), flat(v), o, h0, z0, ht, zt, cu_seqlens, scale, T, H=H, K=K, V=V, BK=BK, BV=BV,
            VARLEN=cu_seqlens is not None, NORM=normalize, HAS_H0=h0 is not None, num_warps=4,
        )
    return o, ht, zt


# --------------------------------------------------------------------------------------------
# backend entry


def segment_chunks_for(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """The automatic ``ns`` of a call, from shapes alone (see ``choose_segment_chunks``)."""
    B, T, H, K = q.shape
    BV = fwd_tile(K, v.shape[-1])[1]
    n_seq = num_seqs(q.shape[0], cu_seqlens)
    return choose_segment_chunks(n_seq, B * T, T, H * math.ceil(v.shape[-1] / BV), q.device)


def triton_linear_attention(
    q, k, v, *, causal=True, normalize=True, scale=None, chunk_size=64,
    initial_state=None, output_final_state=False, cu_seqlens=None, segment_chunks=None,
):
    """Same arguments and results as :func:`lintime.ops.linear_attention`, computed by the Triton
    kernels (chunks of 64 tokens whatever ``chunk_size``: the result does not depend on it).

    fp64 inputs and ``K`` or ``V`` above 256 fall back to the chunked PyTorch form.  A static ``cu_seqlens``
    (:func:`lintime.ops.utils.mark_static`) is planned on the device, never read on the host.  Forward-only
    causal calls of at most 16 tokens (decoding) run the recurrent kernel.  ``segment_chunks``
    overrides the automatic segment length (``0`` = one segment per sequence; tests, benchmarks).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    if not supported(K, V, dtype=q.dtype):
        from lintime.ops.linear.chunk import chunk_linear_attention

        return chunk_linear_attention(
            q, k, v, causal=causal, normalize=normalize, scale=scale, chunk_size=chunk_size,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
    check_device("linear_attention", q)
    h0 = z0 = None
    if initial_state is not None:
        h0, z0 = initial_state if normalize else (initial_state, None)
        h0 = h0.float().contiguous()
        z0 = None if z0 is None else z0.float().contiguous()
    if cu_seqlens is not None:
        static = is_static(cu_seqlens)
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if static and not is_static(cu_seqlens):  # a converted copy: still never read on the host
            cu_seqlens = mark_static(cu_seqlens)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, h0, z0))
    if causal and not grad and T <= DECODE_MAX_T:
        o, ht, zt = linear_recurrent_op(q.contiguous(), k.contiguous(), v.contiguous(), h0, z0, cu_seqlens, scale,
                                        normalize)
    else:
        ns = segment_chunks_for(q, v, cu_seqlens) if segment_chunks is None else int(segment_chunks)
        o, ht, zt = linear_fwd_op(q, k, v, h0, z0, cu_seqlens, scale, causal, normalize, ns)
    state = None
    if output_final_state:
        state = (ht, zt) if normalize else ht
    return o, state
