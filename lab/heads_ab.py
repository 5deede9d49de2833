"""A/B of the GAU / FLASH heads op (:func:`lintime.ops.gau_heads`, fused Triton kernels) at flash-base's shape:
``TT = 32768`` tokens, ``e = 1536``, ``s = 128``, ``nh = 4``, bf16.

    PYTHONPATH=. python3 lab/heads_ab.py [--out f.json] [--reps 30] [--budget 50]

Op rows (``h [TT, 2e + s]`` given): forward, backward launcher alone and fwd+bwd (autograd, the gradients of
``h``, ``gamma``, ``beta`` and the bias) per backward variant, without and with the projection bias:

* ``old``: the backward kernel before the bias fold (a copy below, ``_old_bwd_kernel``: 8-row heads programs
  writing ``[TT/8, nh, s]`` fp32 partials, 8 x 512 tile programs), the same forward kernel without a bias;
* ``rows=R/RH w=W``: the current kernels with ``HeadsLaunch(bwd_rows=R, bwd_heads_rows=RH, bwd_warps=W)`` (row
  groups of the tile / heads programs, looped in registers); the default launch is marked.

Layer rows (``x [TT, 768]``, proj ``[3200, 768]`` + bias, fp32 parameters under bf16 autocast, as the trainer runs
a FLASH layer): ``addmm + old op`` (``F.linear(x, W, b)``, whose backward sums the bias gradient, then the old op)
against ``addmm + new op`` and ``linear + new op(bias)`` (``F.linear(x, W)``, the bias added and its gradient
summed inside the op); fwd+bwd.  Every variant's results are checked against ``old`` (max |a - b| / max |b|).

Medians of CUDA-event times after warm-up (Triton compiles included in the warm-up); a time budget (``--budget``
s) skips the remaining variants once spent.  About 30-40 s on a warm H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lintime.ops.heads.triton.heads import HeadsLaunch, _bwd_impl, _fwd_impl, _inv_freq, triton_gau_heads  # noqa: E402
from lintime.ops.kernel_launch import cdiv, next_pow2  # noqa: E402

# flash-base; ``--smoke``: a tiny shape through Triton's CPU interpreter (the code paths, no timing meaning)
TT, E, S, NH, D = (80, 40, 16, 4, 24) if "--smoke" in sys.argv else (32768, 1536, 128, 4, 768)
W = 2 * E + S
# overrides of the default launch: row groups of the tile (bwd_rows) and heads (bwd_heads_rows) programs, warps
VARIANTS = [dict(bwd_rows=8, bwd_heads_rows=8), dict(bwd_rows=32, bwd_heads_rows=32),
            dict(bwd_rows=64, bwd_heads_rows=64), dict(bwd_rows=128, bwd_heads_rows=128),
            dict(bwd_rows=256, bwd_heads_rows=256), dict(bwd_rows=128, bwd_heads_rows=32),
            dict(bwd_rows=64, bwd_heads_rows=64, bwd_warps=8), dict(bwd_rows=128, bwd_heads_rows=32, bwd_warps=8)]


# --------------------------------------------------------------------------- the backward before the bias fold


@triton.jit
def _silu_grad(x):
    sg = 1.0 / (1.0 + tl.exp(-x))
    return sg * (1.0 + x * (1.0 - sg))


@triton.jit
def _tile(pid, NHB, TT, E, W, GATING: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    NE = tl.cdiv(E, BE)
    if GATING:
        NU = NE
    else:
        NU = 0
    q = pid - NHB
    i_r, i_c = q // (NU + NE), q % (NU + NE)  # row-major (column-major measured no faster)
    is_v = i_c >= NU
    o_t = i_r.to(tl.int64) * BT + tl.arange(0, BT)
    o_e = (i_c - is_v.to(tl.int32) * NU) * BE + tl.arange(0, BE)
    if GATING:
        c0 = is_v.to(tl.int32) * E  # v's columns follow u's
    else:
        c0 = 0
    o_h = o_t[:, None] * W + (c0 + o_e)[None, :]
    o_o = o_t[:, None] * E + o_e[None, :]
    return is_v, o_h, o_o, (o_t < TT)[:, None] & (o_e < E)[None, :]


@triton.jit
def _rope_layout(freq, p_pos, i_r, TT, S: tl.constexpr, HD: tl.constexpr, BTH: tl.constexpr,
                 BH: tl.constexpr):
    o_t = i_r.to(tl.int64) * BTH + tl.arange(0, BTH)
    m_t = o_t < TT
    o_j = tl.arange(0, BH)
    m_j = o_j < S // 2
    o_i = o_j % HD
    c1 = (o_j // HD) * (2 * HD) + o_i
    c2 = c1 + HD
    b_p = tl.load(p_pos + o_t, mask=m_t, other=0).to(tl.float32)
    b_f = tl.load(freq + o_i, mask=m_j, other=0.)
    b_a = b_p[:, None] * b_f[None, :]  # seed Code 3: angle = position * inv_freq
    return o_t, c1, c2, m_j, m_t[:, None] & m_j[None, :], tl.cos(b_a), tl.sin(b_a)


@triton.jit
def _old_bwd_kernel(
    h, du, dv, dheads, gamma, p_pos, freq, dh, dgamma_part, dbeta_part,
    TT, E, W,
    S: tl.constexpr, NH: tl.constexpr, HD: tl.constexpr, GATING: tl.constexpr,
    HAS_DU: tl.constexpr, HAS_DV: tl.constexpr, HAS_DHEADS: tl.constexpr, NEED_DP: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr, BTH: tl.constexpr, BH: tl.constexpr,
):
    pid = tl.program_id(0)
    DT = dh.dtype.element_ty
    NHB = tl.cdiv(TT, BTH)
    if pid < NHB:
        o_t, c1, c2, m_j, m_h, b_cos, b_sin = _rope_layout(freq, p_pos, pid, TT, S, HD, BTH, BH)
        p_z = h + o_t[:, None] * W + (W - S)
        b_z1 = tl.load(p_z + c1[None, :], mask=m_h, other=0.).to(tl.float32)
        b_z2 = tl.load(p_z + c2[None, :], mask=m_h, other=0.).to(tl.float32)
        b_ds1 = tl.zeros([BTH, BH], dtype=tl.float32)  # d silu(z)
        b_ds2 = tl.zeros([BTH, BH], dtype=tl.float32)
        if HAS_DHEADS:
            b_s1 = b_z1 / (1.0 + tl.exp(-b_z1))
            b_s2 = b_z2 / (1.0 + tl.exp(-b_z2))
            for n in tl.static_range(NH):
                p_d = dheads + (o_t[:, None] * NH + n) * S
                b_do1 = tl.load(p_d + c1[None, :], mask=m_h, other=0.).to(tl.float32)
                b_do2 = tl.load(p_d + c2[None, :], mask=m_h, other=0.).to(tl.float32)
                b_dq1 = b_do1 * b_cos + b_do2 * b_sin  # the transposed rotation
                b_dq2 = b_do2 * b_cos - b_do1 * b_sin
                b_g1 = tl.load(gamma + n * S + c1, mask=m_j, other=0.).to(DT).to(tl.float32)
                b_g2 = tl.load(gamma + n * S + c2, mask=m_j, other=0.).to(DT).to(tl.float32)
                b_ds1 += b_dq1 * b_g1[None, :]
                b_ds2 += b_dq2 * b_g2[None, :]
                if NEED_DP:  # padding rows hold dq = 0
                    p_g = dgamma_part + (pid.to(tl.int64) * NH + n) * S
                    p_b = dbeta_part + (pid.to(tl.int64) * NH + n) * S
                    tl.store(p_g + c1, tl.sum(b_dq1 * b_s1, 0), mask=m_j)
                    tl.store(p_g + c2, tl.sum(b_dq2 * b_s2, 0), mask=m_j)
                    tl.store(p_b + c1, tl.sum(b_dq1, 0), mask=m_j)
                    tl.store(p_b + c2, tl.sum(b_dq2, 0), mask=m_j)
        p_dz = dh + o_t[:, None] * W + (W - S)
        tl.store(p_dz + c1[None, :], (b_ds1 * _silu_grad(b_z1)).to(DT), mask=m_h)
        tl.store(p_dz + c2[None, :], (b_ds2 * _silu_grad(b_z2)).to(DT), mask=m_h)
    else:  # a u or v tile
        is_v, o_h, o_o, m_e = _tile(pid, NHB, TT, E, W, GATING, BT, BE)
        b_dy = tl.zeros([BT, BE], dtype=tl.float32)
        if is_v:
            if HAS_DV:
                b_dy = tl.load(dv + o_o, mask=m_e, other=0.).to(tl.float32)
        else:
            if HAS_DU:
                b_dy = tl.load(du + o_o, mask=m_e, other=0.).to(tl.float32)
        b_x = tl.load(h + o_h, mask=m_e, other=0.).to(tl.float32)
        tl.store(dh + o_h, (b_dy * _silu_grad(b_x)).to(DT), mask=m_e)




def old_bwd(du, dv, dheads, h, gamma, pos):
    """The launcher of ``_old_bwd_kernel`` (its defaults then: 8 x 512 tiles, 8-row heads programs, 4 warps)."""
    bt, be, bth = 8, 512, 8
    nhb = cdiv(TT, bth)
    dh = torch.empty_like(h)
    part = torch.empty(2, nhb, NH, S, dtype=torch.float32, device=h.device)
    _old_bwd_kernel[(nhb + cdiv(TT, bt) * 2 * cdiv(E, be),)](
        h, du, dv, dheads, gamma, pos, _inv_freq(S // 2, 10000.0, str(h.device)), dh, part[0], part[1],
        TT, E, W, S=S, NH=NH, HD=S // 2, GATING=True, HAS_DU=True, HAS_DV=True, HAS_DHEADS=True, NEED_DP=True,
        BT=bt, BE=be, BTH=bth, BH=next_pow2(S // 2), num_warps=4,
    )
    return dh, part[0].sum(0), part[1].sum(0)


class OldHeads(torch.autograd.Function):
    """The op before the bias fold: today's forward kernel without a bias, the old backward."""

    @staticmethod
    def forward(ctx, h, gamma, beta, pos):
        ctx.save_for_backward(h, gamma, pos)
        ctx.dtypes = (gamma.dtype, beta.dtype)
        return _fwd_impl(h, gamma, beta, pos, None, E, S, True, 10000.0, 1)

    @staticmethod
    def backward(ctx, du, dv, dheads):
        h, gamma, pos = ctx.saved_tensors
        dh, dg, db = old_bwd(du.contiguous(), dv.contiguous(), dheads.contiguous(), h, gamma, pos)
        return dh, dg.to(ctx.dtypes[0]), db.to(ctx.dtypes[1]), None


def cuda_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn`` between two CUDA events per call, the calls queued back to back after ``warmup``."""
    if not torch.cuda.is_available():  # --smoke
        fn()
        return float("nan")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget", type=float, default=50.0, help="seconds; later variants are skipped once spent")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny fp32 shape: the code paths only")
    a = ap.parse_args()
    t0 = time.perf_counter()
    dev, bf = (torch.device("cpu"), torch.float32) if a.smoke else (torch.device("cuda"), torch.bfloat16)
    if a.smoke:
        a.reps, a.budget = 1, 1e9
    torch.manual_seed(0)
    h = (2 * torch.randn(1, TT, W, device=dev)).to(bf)
    gamma, beta = torch.randn(NH, S, device=dev), torch.randn(NH, S, device=dev)
    bias = 0.5 * torch.randn(W, device=dev)
    pos = torch.arange(TT, device=dev).remainder(8192)[None]  # 4 x 8k sequences
    du, dv = torch.randn(1, TT, E, device=dev, dtype=bf), torch.randn(1, TT, E, device=dev, dtype=bf)
    dheads = torch.randn(1, TT, NH, S, device=dev, dtype=bf)
    grads = (du, dv, dheads)
    default = HeadsLaunch()
    rows, info = [], {"device": "cpu (interpreter)" if a.smoke else torch.cuda.get_device_name(), "TT": TT, "e": E,
                      "s": S, "nh": NH, "dtype": str(bf),
                      "default": dataclasses.asdict(default)}

    def emit(row):
        rows.append(row)
        ms = "  ".join(f"{k} {row[k]:.3f}" for k in ("fwd_ms", "bwd_ms", "fwdbwd_ms") if k in row)
        err = "  ".join(f"{k} {v:.1e}" for k, v in row.get("err", {}).items())
        print(f"{row['case']:6s} {row['name'] + (' +bias' if row.get('bias') else ''):34s} {ms}  {err}", flush=True)

    # ---- the op's old backward first, then the layer rows (both compile the default launch), then the variants
    def op_grad(fn, leaves):
        return lambda: torch.autograd.grad(fn(*leaves), leaves, grads)

    leaves = [x.detach().clone().requires_grad_() for x in (h, gamma, beta)]
    ref = old_bwd(du, dv, dheads, h, gamma, pos)
    ref_b = old_bwd(du, dv, dheads, h + bias.to(bf), gamma, pos)  # the bias added in bf16 first (one more rounding)
    ref_b = (*ref_b, ref_b[0].float().sum((0, 1)))
    emit({"case": "op", "name": "old", "bias": False,
          "fwd_ms": cuda_ms(lambda: _fwd_impl(h, gamma, beta, pos, None, E, S, True, 10000.0, 1), a.reps),
          "bwd_ms": cuda_ms(lambda: old_bwd(du, dv, dheads, h, gamma, pos), a.reps),
          "fwdbwd_ms": cuda_ms(op_grad(lambda x, g, b: OldHeads.apply(x, g, b, pos), leaves), a.reps)})

    # ---- the layer's projection + heads, fp32 parameters under bf16 autocast
    x = torch.randn(1, TT, D, device=dev, dtype=bf).requires_grad_()
    wt = (torch.randn(W, D, device=dev) * D**-0.5).requires_grad_()
    bt = (0.5 * torch.randn(W, device=dev)).requires_grad_()
    g32, b32 = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    params = (x, wt, bt, g32, b32)

    def layer(mode):
        def step():
            with torch.autocast("cuda", bf, enabled=not a.smoke):
                if mode == "addmm + old op":
                    out = OldHeads.apply(F.linear(x, wt, bt), g32, b32, pos)
                elif mode == "addmm + new op":
                    out = triton_gau_heads(F.linear(x, wt, bt), g32, b32, pos, e=E, s=S)
                else:
                    out = triton_gau_heads(F.linear(x, wt), g32, b32, pos, e=E, s=S, bias=bt)
            return torch.autograd.grad(out, params, grads)
        return step

    layer_ref = layer("addmm + old op")()
    for mode in ("addmm + old op", "addmm + new op", "linear + new op(bias)"):
        fn = layer(mode)
        err = {k: rel_err(u, v) for k, u, v in zip(("dx", "dW", "dbias", "dgamma", "dbeta"), fn(), layer_ref)}
        emit({"case": "layer", "name": mode, "err": err, "fwdbwd_ms": cuda_ms(fn, max(a.reps // 2, 10))})

    # ---- the op's backward launches, without and with the bias
    for with_bias in (False, True):
        for over in [{}] + VARIANTS:
            if time.perf_counter() - t0 > a.budget:
                print(f"budget spent: skipped {over} bias={with_bias}", flush=True)
                continue
            cfg = dataclasses.replace(default, **over)
            b = bias if with_bias else None
            name = ("default " if not over else "") + f"rows={cfg.bwd_rows}/{cfg.bwd_heads_rows} w={cfg.bwd_warps}"
            fwd = lambda: triton_gau_heads(h, gamma, beta, pos, e=E, s=S, bias=b, launch=cfg)
            bwd = lambda: _bwd_impl(du, dv, dheads, h, gamma, pos, b, E, S, True, 10000.0, 1, True, b is not None,
                                    cfg)
            lv = leaves + ([bias.clone().requires_grad_()] if with_bias else [])
            fb = op_grad(lambda x, g, be, *bb: triton_gau_heads(x, g, be, pos, e=E, s=S, bias=bb[0] if bb else None,
                                                                 launch=cfg), lv)
            got = bwd()
            want = ref_b if with_bias else ref
            err = {k: rel_err(x, y) for k, x, y in zip(("dh", "dgamma", "dbeta", "dbias"), got, want)}
            emit({"case": "op", "name": name, "bias": with_bias, "launch": dataclasses.asdict(cfg), "err": err,
                  "fwd_ms": cuda_ms(fwd, a.reps), "bwd_ms": cuda_ms(bwd, a.reps), "fwdbwd_ms": cuda_ms(fb, a.reps)})

    info["seconds"] = time.perf_counter() - t0
    print(f"{info['seconds']:.1f} s on {info['device']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
