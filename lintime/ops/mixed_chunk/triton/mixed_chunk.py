"""Mixed chunk attention on fused Triton kernels (seed §3.2, Eqs. 6-8, Codes 1 and 8).

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` key width, ``E`` value width, ``C`` chunk
size, ``N`` sequences, ``NC`` chunks (laid out per sequence), ``NSEG`` segments (runs of ``G``
consecutive chunks of one sequence), ``SDT`` the state dtype of the products
(:func:`lintime.ops.triton_common.dot_config`).

Forward, causal::

    chunk_state_kernel   per (segment, S x E tile): walk the segment's chunks, store the state
                         entering each chunk from inside its segment (HLOC [NC, H, S, E], SDT)
                         and the segment total (fp32); short last chunks add nothing (w_c = 0)
    seg_scan_kernel      (triton_common) per sequence: the state entering each segment
                         (P [NSEG, H, S, E], fp32, starting from initial_state.kv) and the final kv
    relu2_fwd_kernel     per (chunk tile of BM queries, E tile): relu^2 scores of the chunk
                         (Eq. 6) and wq_c * q_lin . (P[seg(c)] + HLOC[c]) (Eq. 8)

Non-causal (Eq. 7): the state pass only sums each sequence (no per-chunk states) and every chunk
reads its sequence's total.  The backward runs the same pass in reverse on ``(q_lin, do)`` with
weights ``wq_c`` (the gradient flowing into each chunk's ``k_lin^T v``, ``G``), then
``relu2_bwd_dv_kernel`` and ``relu2_bwd_dqk_kernel`` (:mod:`lintime.ops.gau.triton.kernels`).

What is materialised: ``HLOC`` per chunk (in SDT, half the bytes of ``v`` at ``S = 128, C = 256``
in bf16) plus fp32 states per segment.  ``G`` (``Blocks.seg_chunks``) trades the two: ``G = 1``
stores exact fp32 per-chunk states from a fully parallel pass and a scan over all chunks;
larger ``G`` walks chunks in registers.  The measured choice is in ``docs/notes/kernels_flash.md``.

A state with a partial chunk (``fill > 0``) is a composition: its buffered tokens are prepended
to their sequence (dummy queries, outputs dropped), exactly as the chunked PyTorch form does, so
every computed sequence starts on a chunk boundary.  The final state's partial-chunk buffers are
gathered from the inputs with differentiable PyTorch indexing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from lintime.ops.gau.triton.kernels import relu2_bwd_dqk_kernel, relu2_bwd_dv_kernel, relu2_fwd_kernel
from lintime.ops.gau.triton.plan import Blocks, default_blocks, fold_bias_grad, sequence_bounds, tiles_of, to_device
from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers
from lintime.ops.mixed_chunk.triton.kernels import chunk_state_kernel
from lintime.ops.triton_common import check_device, custom_op, dot_config, seg_scan_kernel, sm_count

_NORMS = ("tokens", "chunk", "none")


def _sdt_torch(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk states: :func:`dot_config`'s ``SDT`` as a torch dtype."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _n_seqs(B: int, cu_seqlens) -> int:
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _chunk_bound(B: int, T: int, C: int, cu_seqlens) -> int:
    """Chunks of the call, or an upper bound from shapes alone (custom-op outputs must be sized
    without reading ``cu_seqlens``): ``sum_n ceil(L_n / C) <= N + T // C``."""
    if cu_seqlens is None:
        return B * math.ceil(T / C)
    return _n_seqs(B, cu_seqlens) + T // C


def _seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg: Blocks, device) -> int:
    """Chunks per segment ``G``, from shapes only.  One segment per sequence when sequences x
    state tiles already give every SM two programs; otherwise about four programs per SM, never
    fewer than 2 chunks per segment."""
    if cfg.seg_chunks > 0:
        return cfg.seg_chunks
    nct = max(1, _chunk_bound(B, T, C, cu_seqlens))
    tiles = H * triton.cdiv(S, cfg.bs_state) * triton.cdiv(E, cfg.be_state)
    sms = sm_count(device)
    if _n_seqs(B, cu_seqlens) * tiles >= 2 * sms:
        return nct
    want = math.ceil(4 * sms / tiles)
    return min(nct, max(2, math.ceil(nct / want)))


def _seg_bound(B, T, C, cu_seqlens, G) -> int:
    """Segments, or a bound from shapes: ``sum_n ceil(nc_n / G) <= N + NC // G``."""
    if cu_seqlens is None:
        return B * math.ceil(math.ceil(T / C) / G)
    return _n_seqs(B, cu_seqlens) + _chunk_bound(B, T, C, cu_seqlens) // G


@dataclass
class _Plan:
    """Launch tables of one call (device int32) and their sizes."""

    N: int
    NC: int
    NSEG: int
    NT: int
    tile_reg: torch.Tensor
    tile_off: torch.Tensor
    ch_start: torch.Tensor
    ch_len: torch.Tensor
    ch_seq: torch.Tensor
    ch_k: torch.Tensor
    ch_seg: torch.Tensor
    seg_first: torch.Tensor
    seg_n: torch.Tensor
    seq_ptr: torch.Tensor
    lengths: torch.Tensor  # [N] on the device


def _plan(B, T, C, cu_seqlens, bm, G, device) -> _Plan:
    starts, lengths = sequence_bounds(B, T, cu_seqlens)
    N = lengths.numel()
    nch = (lengths + C - 1) // C  # [N]
    seq = torch.arange(N)
    ch_seq = torch.repeat_interleave(seq, nch)
    first_ch = torch.cumsum(nch, 0) - nch
    ch_k = torch.arange(ch_seq.numel()) - first_ch[ch_seq]
    ch_start = starts[ch_seq] + ch_k * C
    ch_len = torch.clamp(lengths[ch_seq] - ch_k * C, max=C)
    tile_reg, tile_off = tiles_of(ch_len, bm)
    nseg = (nch + G - 1) // G
    seq_ptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(nseg, 0)])
    seg_seq = torch.repeat_interleave(seq, nseg)
    seg_k = torch.arange(seg_seq.numel()) - seq_ptr[seg_seq]
    seg_first = first_ch[seg_seq] + seg_k * G
    seg_n = torch.clamp(nch[seg_seq] - seg_k * G, max=G)
    ch_seg = seq_ptr[ch_seq] + ch_k // G
    t = to_device(device, tile_reg, tile_off, ch_start, ch_len, ch_seq, ch_k, ch_seg, seg_first, seg_n, seq_ptr,
                  lengths)
    return _Plan(N, ch_seq.numel(), seg_seq.numel(), tile_reg.numel(), *t)


def _weights(plan: _Plan, C, causal, linear_norm, count0):
    """Per chunk: ``wq`` (the linear part's ``1 / N``) and ``wf`` (whether the chunk's sum enters
    the states: a short last chunk of a causal call feeds no later token)."""
    seq, k, ln = plan.ch_seq.long(), plan.ch_k.long(), plan.ch_len
    if causal:
        wf = (ln == C).to(torch.float32)
    else:
        wf = torch.ones(plan.NC, dtype=torch.float32, device=ln.device)
    if linear_norm == "none":
        wq = torch.ones_like(wf)
    elif linear_norm == "chunk":
        wq = torch.full_like(wf, 1.0 / C)
    else:  # 'tokens': tokens in the sum (seed Code 8's normalised mask); an empty sum gives 0
        if causal:
            n = k * C
            if count0 is not None:
                n = n + count0.to(n.device).long()[seq]
        else:
            n = plan.lengths.long()[seq]
        wq = torch.where(n > 0, 1.0 / n.clamp(min=1).to(torch.float32), torch.zeros_like(wf))
    return wq.contiguous(), wf.contiguous()


def _state_pass(x, y, w, plan: _Plan, *, H, G, cfg, reverse, local, init, causal, sdt):
    """States of the walk direction: ``(LOC [NC_alloc, H, S, E] or empty, START, FINAL)`` where
    causal ``START [NSEG_alloc, H, S, E]`` is the state entering each segment; non-causal calls
    only need ``FINAL [N, H, S, E]`` (each sequence's total)."""
    S, E = x.shape[-1], y.shape[-1]
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    _, PREC = dot_config(x.dtype)
    loc = torch.empty((plan.NC_alloc, H, S, E) if local else (0,), dtype=sdt, device=dev)
    tot = torch.empty(max(plan.NSEG, 1), H, S, E, **f32)
    if plan.NSEG > 0:
        grid = (triton.cdiv(S, cfg.bs_state) * triton.cdiv(E, cfg.be_state), plan.NSEG, H)
        chunk_state_kernel[grid](
            x, y, loc, tot, w, plan.seg_first, plan.seg_n, plan.ch_start, plan.ch_len, S, E, H,
            BS=cfg.bs_state, BE=cfg.be_state, BT=cfg.bt, REVERSE=reverse, STORE_LOCAL=local, PREC=PREC,
            num_warps=cfg.warps_bwd, num_stages=cfg.stages,
        )
    start = torch.empty(plan.NSEG_alloc, H, S, E, **f32) if causal else tot
    final = torch.empty(plan.N, H, S, E, **f32)
    if plan.N > 0:
        SK, SV = min(32, triton.next_power_of_2(max(S, 16))), min(32, triton.next_power_of_2(max(E, 16)))
        grid = (triton.cdiv(S, SK) * triton.cdiv(E, SV), plan.N, H)
        seg_scan_kernel[grid](
            tot, tot, tot, init, init, start, start, final, final, plan.seq_ptr, 0,
            H=H, K=S, V=E, BK=SK, BV=SV, VARLEN=True, USE_G=False, REVERSE=reverse, NORM=False,
            HAS_INIT=init is not None, STORE_START=causal, num_warps=2,
        )
    return loc, start, final


def _launch_plan(B, T, H, S, E, C, cu_seqlens, cfg, device):
    G = _seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg, device)
    plan = _plan(B, T, C, cu_seqlens, cfg.bm, G, device)
    plan.NC_alloc = _chunk_bound(B, T, C, cu_seqlens)
    plan.NSEG_alloc = _seg_bound(B, T, C, cu_seqlens, G)
    return plan, G


def _bias(rel_bias):
    if rel_bias is None:
        return None, 1
    return rel_bias.detach().to(torch.float32).contiguous(), rel_bias.shape[1]


# --------------------------------------------------------------------------------- forward op


def _fwd_fake(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, blocks):
    B, T, H, S = qq.shape
    E = v.shape[-1]
    cfg = Blocks.from_list(blocks)
    G = _seg_chunks(B, T, H, S, E, chunk_size, cu_seqlens, cfg, qq.device)
    N = _n_seqs(B, cu_seqlens)
    f32 = dict(dtype=torch.float32, device=qq.device)
    if not causal:
        return torch.empty_like(v), qq.new_empty(0, dtype=torch.float32), qq.new_empty(0), torch.empty(N, H, S, E, **f32)
    nc = _chunk_bound(B, T, chunk_size, cu_seqlens)
    hloc = qq.new_empty((nc, H, S, E) if G > 1 else (0,), dtype=_sdt_torch(qq.dtype))
    nseg = _seg_bound(B, T, chunk_size, cu_seqlens, G)
    return torch.empty_like(v), torch.empty(N, H, S, E, **f32), hloc, torch.empty(nseg, H, S, E, **f32)


def _mixed_chunk_fwd(
    qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor, kl: torch.Tensor, v: torch.Tensor,
    rel_bias: torch.Tensor | None, kv0: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, chunk_size: int, causal: bool, scale: float, linear_norm: str,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, final kv, HLOC, START)``; the last two are what the backward reads (causal: per-chunk
    and per-segment states; non-causal: ``HLOC`` empty, ``START`` the per-sequence totals)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    cfg = Blocks.from_list(blocks)
    plan, G = _launch_plan(B, T, H, S, E, C, cu_seqlens, cfg, qq.device)
    local = causal and G > 1
    sdt = _sdt_torch(qq.dtype)
    wq, wf = _weights(plan, C, causal, linear_norm, count0)
    loc, start, final = _state_pass(kl, v, wf, plan, H=H, G=G, cfg=cfg, reverse=False, local=local,
                                    init=kv0 if causal else None, causal=causal, sdt=sdt)
    o = torch.empty_like(v)
    bias, LB = _bias(rel_bias)
    SDT, PREC = dot_config(qq.dtype)
    if plan.NT > 0:
        relu2_fwd_kernel[(triton.cdiv(E, cfg.be_fwd), plan.NT, H)](
            qq, kq, v, o, bias if bias is not None else qq,
            ql, start if causal else final, loc, wq, plan.ch_seg if causal else plan.ch_seq,
            plan.tile_reg, plan.tile_off, plan.ch_start, plan.ch_len,
            float(scale), S, E, H, LB, C - 1,
            BM=cfg.bm, BS=cfg.bs, BE=cfg.be_fwd, CAUSAL=causal, HAS_BIAS=bias is not None, HAS_LIN=True,
            HAS_LOCAL=local, ONE_S=cfg.bs >= S, PREC=PREC, SDT=SDT, num_warps=cfg.warps_fwd, num_stages=cfg.stages,
        )
    if not causal:
        return o, qq.new_empty(0, dtype=torch.float32), qq.new_empty(0), final
    return o, final, loc if local else qq.new_empty(0, dtype=sdt), start


# --------------------------------------------------------------------------------- backward op


def _bwd_fake(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, hloc, start, chunk_size, causal, scale,
              linear_norm, need_db, has_kv0, blocks):
    B, T, H, S = qq.shape
    E = v.shape[-1]
    db = rel_bias.new_empty(rel_bias.shape) if (need_db and rel_bias is not None) else qq.new_empty(0)
    N = _n_seqs(B, cu_seqlens)
    dkv0 = qq.new_empty((N, H, S, E), dtype=torch.float32) if has_kv0 else qq.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(qq), torch.empty_like(kq), torch.empty_like(ql), torch.empty_like(kl),
            torch.empty_like(v), db, dkv0)


@custom_op("mixed_chunk_bwd", _bwd_fake)
def mixed_chunk_bwd(
    do: torch.Tensor, dkv: torch.Tensor | None, qq: torch.Tensor, kq: torch.Tensor, ql: torch.Tensor,
    kl: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None, count0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, hloc: torch.Tensor, start: torch.Tensor, chunk_size: int, causal: bool,
    scale: float, linear_norm: str, need_db: bool, has_kv0: bool, blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the five inputs, of ``rel_bias`` (empty unless ``need_db``) and of the initial
    ``kv`` (empty unless ``has_kv0``)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    cfg = Blocks.from_list(blocks)
    dev = qq.device
    do = do.contiguous()
    plan, G = _launch_plan(B, T, H, S, E, C, cu_seqlens, cfg, dev)
    local = causal and G > 1
    wq, wf = _weights(plan, C, causal, linear_norm, count0)
    init = dkv.contiguous() if (causal and dkv is not None) else None
    gloc, gstart, gfinal = _state_pass(ql, do, wq, plan, H=H, G=G, cfg=cfg, reverse=True, local=local,
                                       init=init, causal=causal, sdt=_sdt_torch(qq.dtype))
    hst, gst = (start, gstart) if causal else (start, gfinal)
    pidx = plan.ch_seg if causal else plan.ch_seq
    bias, LB = _bias(rel_bias)
    need_db = need_db and bias is not None
    SDT, PREC = dot_config(qq.dtype)
    dv = torch.empty_like(v)
    dql, dkl = torch.empty_like(ql), torch.empty_like(kl)
    dq32 = torch.zeros(qq.shape, dtype=torch.float32, device=dev)
    dk32 = torch.zeros(kq.shape, dtype=torch.float32, device=dev)
    ntd = 2 * triton.cdiv(C, cfg.bm) - 1
    db_tiles = torch.zeros((H, ntd, cfg.bm, cfg.bm) if need_db else (1,), dtype=torch.float32, device=dev)
    if plan.NT > 0:
        b_ptr = bias if bias is not None else qq
        common = dict(BM=cfg.bm, BS=cfg.bs, CAUSAL=causal, HAS_BIAS=bias is not None, HAS_LIN=True, HAS_LOCAL=local,
                      ONE_S=cfg.bs >= S, PREC=PREC, SDT=SDT, num_warps=cfg.warps_bwd, num_stages=cfg.stages)
        tables = (plan.tile_reg, plan.tile_off, plan.ch_start, plan.ch_len)
        relu2_bwd_dv_kernel[(triton.cdiv(E, cfg.be_dv), plan.NT, H)](
            qq, kq, do, dv, b_ptr, kl, gst, gloc, wf, pidx, *tables,
            float(scale), S, E, H, LB, C - 1, BE=cfg.be_dv, **common,
        )
        relu2_bwd_dqk_kernel[(plan.NT, H)](
            qq, kq, v, do, dq32, dk32, db_tiles, b_ptr,
            ql, kl, dql, dkl, hst, hloc, gst, gloc, wq, wf, pidx, *tables,
            float(scale), S, E, H, LB, C - 1, ntd, BE=cfg.be_red, NEED_DB=need_db, **common,
        )
    db = fold_bias_grad(db_tiles, LB, C - 1, cfg.bm).to(rel_bias.dtype) if need_db else qq.new_empty(0)
    dkv0 = gfinal if (causal and has_kv0) else qq.new_empty(0, dtype=torch.float32)
    return dq32.to(qq.dtype), dk32.to(kq.dtype), dql, dkl, dv, db, dkv0


def _setup(ctx, inputs, output):
    qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm, blocks = inputs
    _, _, hloc, start = output
    ctx.mark_non_differentiable(hloc, start)
    ctx.save_for_backward(qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, hloc, start)
    ctx.args = (chunk_size, causal, scale, linear_norm)
    ctx.blocks = blocks
    ctx.has_kv0 = kv0 is not None


def _backward(ctx, do, dkv, _dhloc, _dstart):
    qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, hloc, start = ctx.saved_tensors
    need_db = rel_bias is not None and ctx.needs_input_grad[5]
    has_kv0 = ctx.has_kv0 and ctx.needs_input_grad[6]
    if dkv is not None and dkv.numel() == 0:
        dkv = None
    dqq, dkq, dql, dkl, dv, db, dkv0 = mixed_chunk_bwd(
        do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, hloc, start, *ctx.args, need_db, has_kv0,
        ctx.blocks,
    )
    return (dqq, dkq, dql, dkl, dv, db if need_db else None, dkv0 if has_kv0 else None,
            None, None, None, None, None, None, None)


mixed_chunk_fwd = custom_op("mixed_chunk_fwd", _fwd_fake, backward=_backward, setup_context=_setup)(_mixed_chunk_fwd)


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
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None, blocks: Blocks | None = None,
):
    """Fused mixed chunk attention: same arguments and results as
    :func:`lintime.ops.mixed_chunk.naive.naive_mixed_chunk_attention` (``q_*, k_*`` ``[B, T, H, S]``,
    ``v`` ``[B, T, H, E]``, ``rel_bias`` ``[H, 2C - 1]``); fp16 / bf16 / fp32 inputs, fp32
    accumulation, ``S <= 512`` and ``E <= 4096`` tiled.  ``blocks`` overrides the block sizes
    (:func:`lintime.ops.gau.triton.plan.default_blocks`).  fp64 inputs and empty calls go to the
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
    blocks = blocks or default_blocks(S, E, q_quad.dtype)
    xs = [q_quad, k_quad, q_lin, k_lin, v]
    kv0 = count0 = keep = None
    if initial_state is not None:
        kv0 = initial_state.kv.to(torch.float32)
        count0 = initial_state.count
        fills = initial_state.fill.tolist()
        if any(fills):
            from lintime.ops.mixed_chunk.chunk import _prepend_buffers
            from lintime.ops.utils import seq_bounds

            bufs = clean_buffers(initial_state, q_quad.dtype)
            xs, cu_seqlens, keep = _prepend_buffers(xs, bufs, fills, seq_bounds(B, T, cu_seqlens))
    xs = [x.contiguous() for x in xs]
    Bx, Tx = xs[0].shape[:2]
    o, final_kv, _, _ = mixed_chunk_fwd(*xs, rel_bias, kv0, count0, cu_seqlens, C, bool(causal), scale,
                                        linear_norm, blocks.to_list())
    if keep is not None:
        o = o.reshape(Bx * Tx, H, E).index_select(0, keep).view(B, T, H, E)
    if not output_final_state:
        return o, None
    starts, lengths = (x.to(q_quad.device) for x in sequence_bounds(Bx, Tx, cu_seqlens))
    flat = [x.view(Bx * Tx, H, x.shape[-1]) for x in (xs[1], xs[3], xs[4])]
    (bk, bl, bv), fill = _final_buffers(flat, starts, lengths, C)
    done = lengths - fill
    state = MixedChunkState(
        kv=final_kv.to(initial_state.kv.dtype) if initial_state is not None else final_kv,
        count=done if count0 is None else count0 + done,
        k_quad=bk, k_lin=bl, v=bv, fill=fill,
    )
    return o, state
