"""Mixed chunk attention on fused Triton kernels (seed §3.2, Eqs. 6-8, Codes 1 and 8): the custom ops
``lintime::mixed_chunk_fwd`` / ``lintime::mixed_chunk_bwd`` (:func:`~lintime.ops.utils.launching.launcher_op`), and the entry
:func:`triton_mixed_chunk_attention` (the ``"triton"`` backend of :func:`lintime.ops.mixed_chunk_attention`).

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` key width, ``E`` value width, ``C`` chunk
size, ``N`` sequences, ``NC`` chunks (laid out per sequence), ``NSEG`` segments (runs of
consecutive chunks of one sequence walked by one program), ``SDT`` the dtype of the per-chunk
states (:func:`lintime.ops.utils.launching.dot_config`: bf16 for bf16 inputs, fp32 otherwise).

The kernels (:mod:`.walk`, :mod:`.kernels`) and their launch order (:mod:`.launchers`); the host-side tables and shape rules
(:mod:`.plan`); the launch configuration (:class:`.launch.MixedChunkLaunch`).  What is materialised: ``A`` and
``dS`` (input dtype, ``T * C`` elements each), ``H`` and ``G`` (``T * S * E / C`` elements each, half of ``v`` at
``S = 128, C = 256``), so each large product runs once, as a GEMM-shaped tile loop; the forward saves ``A`` and
``H`` for the backward.

A state with a partial chunk (``fill > 0``) is a composition: its buffered tokens are prepended
to their sequence (dummy queries, outputs dropped), exactly as the chunked PyTorch form does, so
every computed sequence starts on a chunk boundary.  The final state's partial-chunk buffers are
gathered from the inputs with differentiable PyTorch indexing.
"""

from __future__ import annotations

import torch

from lintime.ops.utils.launching import check_device, grad_as, launcher_op
from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch, default_launch
from lintime.ops.mixed_chunk.triton.launchers import bwd_impl, fwd_impl
from lintime.ops.mixed_chunk.triton.plan import sdt_torch
from lintime.ops.utils.segments import chunk_bound
from lintime.ops.utils import is_static, num_seqs, sequence_bounds

# --------------------------------------------------------------------------------- custom ops


def _fwd_fake(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, defined,
              launch):
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    N = num_seqs(B, cu_seqlens)
    nc = chunk_bound(B, T, C, cu_seqlens)
    f32 = {"dtype": torch.float32, "device": qq.device}
    a = qq.new_empty(nc, H, C, C)
    st = qq.new_empty((nc if causal else N, H, S, E), dtype=sdt_torch(qq.dtype))
    final = torch.empty(N, H, S, E, **f32) if causal else qq.new_empty(0, dtype=torch.float32)
    return torch.empty_like(v), final, a, st


def _bwd_fake(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
              linear_norm, need_db, has_kv0, launch):
    B, _, H, S = qq.shape
    E = v.shape[-1]
    db = rel_bias.new_empty(rel_bias.shape) if (need_db and rel_bias is not None) else qq.new_empty(0)
    N = num_seqs(B, cu_seqlens)
    dkv0 = qq.new_empty((N, H, S, E), dtype=torch.float32) if has_kv0 else qq.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(qq), torch.empty_like(kq), torch.empty_like(ql), torch.empty_like(kl),
            torch.empty_like(v), db, dkv0)


@launcher_op("mixed_chunk_bwd", fake=_bwd_fake)
def mixed_chunk_bwd(
    do: torch.Tensor, dkv: torch.Tensor | None, qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor,
    kl: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, a: torch.Tensor, st: torch.Tensor, chunk_size: int, causal: bool,
    scale: float, linear_norm: str, need_db: bool, has_kv0: bool, launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the five inputs, of ``rel_bias`` (empty unless ``need_db``) and of the initial
    ``kv`` (empty unless ``has_kv0``)."""
    return bwd_impl(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
                    linear_norm, need_db, has_kv0, MixedChunkLaunch.of(launch))


def _setup(ctx, inputs, output):
    qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, _, launch = inputs
    _, _, a, st = output
    if not getattr(ctx, "lintime_eager", False):  # the op's outputs; the eager Function returns only (o, kv)
        ctx.mark_non_differentiable(a, st)
    ctx.save_for_backward(qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st)
    ctx.args = (chunk_size, causal, scale, linear_norm)
    ctx.launch = launch
    ctx.has_kv0 = kv0 is not None


def _backward(ctx, do, dkv, _da, _dst):
    """Backward of ``lintime::mixed_chunk_fwd`` through ``lintime::mixed_chunk_bwd`` (traced by ``torch.compile``
    and opcheck), or its launcher in eager calls."""
    qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st = ctx.saved_tensors
    need_db = rel_bias is not None and ctx.needs_input_grad[5]
    has_kv0 = ctx.has_kv0 and ctx.needs_input_grad[6]
    if dkv is not None and dkv.numel() == 0:
        dkv = None
    if do is None:  # only the final state is used (eager calls materialise no zero gradients)
        do = torch.zeros_like(v)
    do, dkv = grad_as(do, v.dtype), grad_as(dkv, torch.float32)
    dqq, dkq, dql, dkl, dv, db, dkv0 = mixed_chunk_bwd.for_ctx(ctx)(
        do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, *ctx.args, need_db, has_kv0, ctx.launch,
    )
    return (dqq, dkq, dql, dkl, dv, db if need_db else None, dkv0 if has_kv0 else None,
            None, None, None, None, None, None, None, None)


@launcher_op("mixed_chunk_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup, outputs=2)
def mixed_chunk_fwd(
    qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor, kl: torch.Tensor, v: torch.Tensor,
    rel_bias: torch.Tensor | None, kv0: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, chunk_size: int, causal: bool, scale: float, linear_norm: str, defined: bool,
    launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final kv)`` (the op returns ``A`` and ``H`` too, saved for the backward; non-causal: ``H`` holds each
    sequence's total and the final kv is empty).  ``defined``: zero the entries of ``A`` no kernel writes -- true
    wherever ``A`` leaves the launcher as a custom op's output (:func:`_forward`); eager calls skip the fill, their
    ``A`` reaches only the backward kernels, which never read those entries.  ``launch``: the
    :class:`MixedChunkLaunch`, or it as :meth:`~lintime.ops.utils.launching.LaunchConfig.to_ints`."""
    return fwd_impl(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
                    MixedChunkLaunch.of(launch), zero_a=defined)


def _forward(*args, launch: MixedChunkLaunch):
    """``(o, final kv)`` of the call through :func:`mixed_chunk_fwd`: the custom op under ``torch.compile`` (``A``
    fully defined, the config as ints), else the eager Function or the bare launcher (the config object, no fill)."""
    if torch.compiler.is_compiling():
        return mixed_chunk_fwd(*args, True, launch.to_ints())
    return mixed_chunk_fwd(*args, False, launch)


# --------------------------------------------------------------------------------- entry


def _final_buffers(xs, starts, lengths, C):
    """The partial last chunk of each sequence (``fill = L % C`` tokens, zero past ``fill``) of the
    flat inputs ``xs`` (``k_quad, k_lin, v`` as ``[TT, H, D]``): differentiable gathers."""
    dev = xs[0].device
    fill = lengths % C
    first = starts + lengths - fill  # [N]
    slot = torch.arange(C, device=dev)
    idx = (first[:, None] + slot[None, :]).clamp(max=max(xs[0].shape[0] - 1, 0))  # [N, C]
    keep = (slot[None, :] < fill[:, None])[:, :, None, None]
    out = []
    for x in xs:
        g = x.index_select(0, idx.reshape(-1)).view(idx.shape[0], C, *x.shape[1:])
        out.append(torch.where(keep, g, torch.zeros((), dtype=x.dtype, device=dev)))
    return out, fill


def triton_mixed_chunk_attention(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size=256, causal=True, rel_bias=None, scale=None,
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None,
    launch: MixedChunkLaunch | None = None,
):
    """Fused mixed chunk attention: same arguments and results as
    :func:`lintime.ops.mixed_chunk.naive.naive_mixed_chunk_attention` (``q_*, k_*`` ``[B, T, H, S]``,
    ``v`` ``[B, T, H, E]``, ``rel_bias`` ``[H, 2C - 1]``); fp16 / bf16 / fp32 inputs, fp32
    accumulation, ``S <= 512`` and ``E <= 4096`` tiled.  ``launch`` overrides the launch configuration
    (:func:`lintime.ops.mixed_chunk.triton.launch.default_launch`).  fp64 inputs and empty calls go to the
    chunked PyTorch form."""
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    C = chunk_size
    if q_quad.dtype == torch.float64 or B * T == 0:
        from lintime.ops.mixed_chunk.chunk import chunk_mixed_chunk_attention

        return chunk_mixed_chunk_attention(
            q_quad, k_quad, q_lin, k_lin, v, chunk_size=C, causal=causal, rel_bias=rel_bias, scale=scale,
            linear_norm=linear_norm, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )
    check_device("mixed_chunk_attention", q_quad)
    scale = 1.0 / C if scale is None else float(scale)
    launch = launch or default_launch(S, E, q_quad.dtype, C)
    xs = [q_quad, k_quad, q_lin, k_lin, v]
    kv0 = count0 = keep = None
    if initial_state is not None:
        kv0 = initial_state.kv.to(torch.float32)
        count0 = initial_state.count
        fills = initial_state.fill.tolist()
        if any(fills):
            if is_static(cu_seqlens):
                raise ValueError("mixed_chunk_attention: a state with buffered tokens (fill > 0) needs its sequences "
                                 "re-packed on the host, which a static cu_seqlens (fixed-size plan, no host read) "
                                 "cannot do: pass the offsets as an ordinary tensor")
            from lintime.ops.mixed_chunk.chunk import _prepend_buffers
            from lintime.ops.utils import row_spans

            bufs = clean_buffers(initial_state, q_quad.dtype)
            xs, cu_seqlens, keep = _prepend_buffers(xs, bufs, fills, row_spans(B, T, cu_seqlens))
    xs = [x.contiguous() for x in xs]
    Bx, Tx = xs[0].shape[:2]
    o, final_kv = _forward(*xs, rel_bias, kv0, count0, cu_seqlens, C, bool(causal), scale, linear_norm,
                           launch=launch)
    if keep is not None:
        o = o.reshape(Bx * Tx, H, E).index_select(0, keep).view(B, T, H, E)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        starts, lengths = (x.to(q_quad.device) for x in sequence_bounds(Bx, Tx, None))
    else:  # on the device, no host read (a static cu_seqlens has no other way)
        cu = cu_seqlens.to(q_quad.device, torch.long)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    flat = [x.view(Bx * Tx, H, x.shape[-1]) for x in (xs[1], xs[3], xs[4])]
    (bk, bl, bv), fill = _final_buffers(flat, starts, lengths, C)
    done = lengths - fill
    state = MixedChunkState(
        kv=final_kv.to(initial_state.kv.dtype) if initial_state is not None else final_kv,
        count=done if count0 is None else count0 + done,
        k_quad=bk, k_lin=bl, v=bv, fill=fill,
    )
    return o, state
