"""Experiment (session 7): TMA tensor-descriptor loads and warp specialisation for mixed chunk's
output / dV GEMM and its state walk, against the library's kernels, on one GPU.

Standalone: full 256-token chunks, H = 1, S = 128, E = 2048, bf16, 32k tokens (the issue's shape);
every variant's output is checked against the library kernel's before it is timed (CUDA-graph
replays, median).  Prints one line per variant and writes JSON to ``$OUT`` when set.

    PYTHONPATH=. python3 benchmarks/exp_tma_mixed_chunk.py
"""

# ruff: noqa: B023, BLE001 - each closure is timed inside its own loop iteration; a variant that fails to compile is
# reported and the experiment goes on

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lintime.ops.mixed_chunk.triton.kernels import chunk_state_kernel, mc_gemm_kernel


@triton.jit
def gemm_tma_kernel(
    d_a, d_y, d_l, d_st, W, OUT, d_o,
    S, E, C, NMT,
    BG: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
    TRANS: tl.constexpr, WS: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """Full chunks, H = 1, causal; chunk ``c`` = tokens ``[c C, (c + 1) C)``, state index ``c``."""
    i_e = tl.program_id(0)
    pid = tl.program_id(1)
    c = pid // NMT
    m0 = (pid % NMT) * BG
    cs = c * C
    e0 = i_e * BE
    w = tl.load(W + c)
    acc = tl.zeros([BG, BE], dtype=tl.float32)
    for s0 in tl.range(0, S, BK, warp_specialize=WS):
        b_l = d_l.load([cs + m0, s0])
        b_st = d_st.load([c * S + s0, e0])
        acc = tl.dot(b_l, b_st, acc)
    acc = acc * w
    if TRANS:
        lo = m0
        hi = C
    else:
        lo = 0
        hi = m0 + BG
    for k0 in tl.range(lo, hi, BK, warp_specialize=WS):
        if TRANS:
            b_a = tl.trans(d_a.load([cs + k0, m0]))
        else:
            b_a = d_a.load([cs + m0, k0])
        b_y = d_y.load([cs + k0, e0])
        acc = tl.dot(b_a, b_y, acc)
    if TMA_STORE:
        d_o.store([cs + m0, e0], acc.to(d_o.dtype))
    else:
        o_m = cs + m0 + tl.arange(0, BG)
        o_e = e0 + tl.arange(0, BE)
        tl.store(OUT + o_m[:, None].to(tl.int64) * E + o_e[None, :], acc.to(OUT.dtype.element_ty))


@triton.jit
def gemm_dev_kernel(
    A, Y, L, ST, W, OUT, NT, NC,
    S, E, C, NMT,
    BG: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr,
):
    """As gemm_tma_kernel, with the descriptors made on the device (tl.make_tensor_descriptor)."""
    if TRANS:
        d_a = tl.make_tensor_descriptor(A, shape=[NC * C, C], strides=[C, 1], block_shape=[BK, BG])
    else:
        d_a = tl.make_tensor_descriptor(A, shape=[NC * C, C], strides=[C, 1], block_shape=[BG, BK])
    d_y = tl.make_tensor_descriptor(Y, shape=[NT, E], strides=[E, 1], block_shape=[BK, BE])
    d_l = tl.make_tensor_descriptor(L, shape=[NT, S], strides=[S, 1], block_shape=[BG, BK])
    d_st = tl.make_tensor_descriptor(ST, shape=[NC * S, E], strides=[E, 1], block_shape=[BK, BE])
    i_e = tl.program_id(0)
    pid = tl.program_id(1)
    c = pid // NMT
    m0 = (pid % NMT) * BG
    cs = c * C
    e0 = i_e * BE
    w = tl.load(W + c)
    acc = tl.zeros([BG, BE], dtype=tl.float32)
    for s0 in range(0, S, BK):
        b_l = d_l.load([cs + m0, s0])
        b_st = d_st.load([c * S + s0, e0])
        acc = tl.dot(b_l, b_st, acc)
    acc = acc * w
    if TRANS:
        lo = m0
        hi = C
    else:
        lo = 0
        hi = m0 + BG
    for k0 in range(lo, hi, BK):
        if TRANS:
            b_a = tl.trans(d_a.load([cs + k0, m0]))
        else:
            b_a = d_a.load([cs + m0, k0])
        b_y = d_y.load([cs + k0, e0])
        acc = tl.dot(b_a, b_y, acc)
    o_m = cs + m0 + tl.arange(0, BG)
    o_e = e0 + tl.arange(0, BE)
    tl.store(OUT + o_m[:, None].to(tl.int64) * E + o_e[None, :], acc.to(OUT.dtype.element_ty))


@triton.jit
def walk_tma_kernel(
    d_x, d_y, HOUT, TOT, S, E, C, NCS,
    BS: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, WS: tl.constexpr,
):
    """Forward walk, one segment = ``NCS`` full chunks of one sequence, H = 1."""
    i_se, i_g = tl.program_id(0), tl.program_id(1)
    NE = tl.cdiv(E, BE)
    i_s, i_e = i_se // NE, i_se % NE
    o_s = i_s * BS + tl.arange(0, BS)
    o_e = i_e * BE + tl.arange(0, BE)
    o_se = o_s[:, None] * E + o_e[None, :]
    b_h = tl.zeros([BS, BE], dtype=tl.float32)
    for i in range(NCS):
        c = i_g * NCS + i
        tl.store(HOUT + c.to(tl.int64) * S * E + o_se, b_h.to(HOUT.dtype.element_ty))
        cs = c * C
        b_d = tl.zeros([BS, BE], dtype=tl.float32)
        for t0 in tl.range(0, C, BT, warp_specialize=WS):
            b_x = d_x.load([cs + t0, i_s * BS])
            b_y = d_y.load([cs + t0, i_e * BE])
            b_d = tl.dot(tl.trans(b_x), b_y, b_d)
        b_h += b_d
    tl.store(TOT + i_g.to(tl.int64) * S * E + o_se, b_h)


def host_us(fn, n=200):
    """Host microseconds per call (launches queued, one sync at the end)."""
    import time
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main():
    torch.manual_seed(0)
    dev = "cuda"
    dt = torch.bfloat16
    S, E, C, NT, T = 128, 2048, 256, 32768, 2048
    NC = NT // C
    A = torch.randn(NC, 1, C, C, device=dev, dtype=dt).tril_() * 0.05
    v = torch.randn(NT, 1, E, device=dev, dtype=dt)
    do = torch.randn(NT, 1, E, device=dev, dtype=dt)
    ql = torch.randn(NT, 1, S, device=dev, dtype=dt)
    kl = torch.randn(NT, 1, S, device=dev, dtype=dt)
    st = (torch.randn(NC, 1, S, E, device=dev, dtype=dt) * 0.1)
    w = torch.rand(NC, device=dev, dtype=torch.float32)
    ch_start = torch.arange(NC, device=dev, dtype=torch.int32) * C
    ch_len = torch.full((NC,), C, device=dev, dtype=torch.int32)
    ch_id = torch.arange(NC, device=dev, dtype=torch.int32)
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
               "rows": []}

    def row(name, ms, err=None, note=""):
        r = {"name": name, "ms": ms, "max_err": err, "note": note}
        results["rows"].append(r)
        print(f"{name:40s} {(f'{ms:.4f} ms' if ms is not None else 'FAILED'):>12s}  err={err}  {note}", flush=True)

    # ------------------------------------------------------------------ GEMMs (forward o, backward dv)
    for trans in (False, True):
        Y = do if trans else v
        L = kl if trans else ql
        ref = torch.empty_like(v)

        def base(bg=64, be=128, bk=64, warps=4, stages=3, out=ref):
            nmt = C // bg
            mc_gemm_kernel[(E // be, NC * nmt, 1)](
                A, Y, L, st, A, Y, L, st, w, ch_id, out, ch_start, ch_len, S, E, 1, C, nmt,
                BG=bg, BE=be, BK=bk, TRANS=trans, CAUSAL=True, PREC="tf32", SDT=tl.bfloat16, TMA=False,
                num_warps=warps, num_stages=stages)

        tag = "dv" if trans else "o"
        row(f"{tag} base bg64 be128 w4 s3", bench(base), 0.0)
        for bg, be, warps in ((128, 128, 8),):
            out = torch.empty_like(v)
            t = bench(lambda: base(bg=bg, be=be, warps=warps, out=out))
            row(f"{tag} base bg{bg} be{be} w{warps} s3", t, (out - ref).abs().max().item())
        for bg, be, bk, warps, stages, ws, tstore in (
            (64, 128, 64, 4, 3, False, False),
            (128, 128, 64, 4, 3, False, False),
            (128, 128, 64, 4, 4, False, False),
            (128, 256, 64, 8, 3, False, False),
        ):
            name = f"{tag} tma bg{bg} be{be} bk{bk} w{warps} s{stages}{' ws' if ws else ''}{' tstore' if tstore else ''}"
            try:
                out = torch.empty_like(v)
                d_a = TensorDescriptor.from_tensor(A.view(NC * C, C), [bk, bg] if trans else [bg, bk])
                d_y = TensorDescriptor.from_tensor(Y.view(NT, E), [bk, be])
                d_l = TensorDescriptor.from_tensor(L.view(NT, S), [bg, bk])
                d_st = TensorDescriptor.from_tensor(st.view(NC * S, E), [bk, be])
                d_o = TensorDescriptor.from_tensor(out.view(NT, E), [bg, be])
                nmt = C // bg

                def fn():
                    gemm_tma_kernel[(E // be, NC * nmt)](
                        d_a, d_y, d_l, d_st, w, out, d_o, S, E, C, nmt,
                        BG=bg, BE=be, BK=bk, TRANS=trans, WS=ws, TMA_STORE=tstore,
                        num_warps=warps, num_stages=stages)

                t = bench(fn)
                row(name, t, (out - ref).abs().max().item())
            except Exception as exc:  # report and go on: the point is which variants compile
                traceback.print_exc(limit=2)
                row(name, None, None, f"{type(exc).__name__}: {str(exc)[:200]}")

        # device-side descriptors (no host-side descriptor encoding per launch)
        try:
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
            out = torch.empty_like(v)

            def fn_dev():
                gemm_dev_kernel[(E // 128, NC * 4)](A, Y, L, st, w, out, NT, NC, S, E, C, 4,
                                                    BG=64, BE=128, BK=64, TRANS=trans, num_warps=4, num_stages=3)

            row(f"{tag} devdesc bg64 be128 w4 s3", bench(fn_dev), (out - ref).abs().max().item())
            results[f"{tag}_host_us_devdesc"] = host_us(fn_dev)
        except Exception as exc:
            traceback.print_exc(limit=2)
            row(f"{tag} devdesc", None, None, f"{type(exc).__name__}: {str(exc)[:200]}")
        # host time per launch: pointers vs host descriptors made per call
        out = torch.empty_like(v)

        def fn_host_desc():
            d_a = TensorDescriptor.from_tensor(A.view(NC * C, C), [64, 64])
            d_y = TensorDescriptor.from_tensor(Y.view(NT, E), [64, 128])
            d_l = TensorDescriptor.from_tensor(L.view(NT, S), [64, 64])
            d_st = TensorDescriptor.from_tensor(st.view(NC * S, E), [64, 128])
            gemm_tma_kernel[(E // 128, NC * 4)](d_a, d_y, d_l, d_st, w, out, d_y, S, E, C, 4, BG=64, BE=128, BK=64,
                                               TRANS=trans, WS=False, TMA_STORE=False, num_warps=4, num_stages=3)

        results[f"{tag}_host_us_pointers"] = host_us(lambda: base(out=out))
        results[f"{tag}_host_us_hostdesc"] = host_us(fn_host_desc)
        print(f"{tag} host us per launch: pointers {results[f'{tag}_host_us_pointers']:.1f}, host descriptors "
              f"{results[f'{tag}_host_us_hostdesc']:.1f}, device descriptors {results.get(f'{tag}_host_us_devdesc')}",
              flush=True)

    # ------------------------------------------------------------------ state walk (forward)
    NCS = T // C  # one segment per 2k sequence
    NSEG = NC // NCS
    seg_first = torch.arange(NSEG, device=dev, dtype=torch.int32) * NCS
    seg_n = torch.full((NSEG,), NCS, device=dev, dtype=torch.int32)
    seg_seq = torch.arange(NSEG, device=dev, dtype=torch.int32)
    ones = torch.ones(NC, device=dev, dtype=torch.float32)
    h_ref = torch.empty(NC, 1, S, E, device=dev, dtype=dt)
    tot_ref = torch.empty(NSEG, 1, S, E, device=dev, dtype=torch.float32)

    def walk_base(bs=128, be=64, bt=64, warps=4, stages=3, hout=h_ref, tot=tot_ref):
        chunk_state_kernel[(triton.cdiv(S, bs) * triton.cdiv(E, be), NSEG, 1)](
            kl, v, kl, v, hout, tot, tot, ones, seg_first, seg_n, seg_seq, ch_start, ch_len, S, E, 1,
            BS=bs, BE=be, BT=bt, REVERSE=False, STORE=True, HAS_INIT=False, PREC="tf32", TMA=False,
            num_warps=warps, num_stages=stages)

    row("walk base bs128 be64 bt64 w4 s3", bench(walk_base), 0.0)
    for stages in (3, 4):
        hout = torch.empty_like(h_ref)
        tot = torch.empty_like(tot_ref)
        dx = TensorDescriptor.from_tensor(kl.view(NT, S), [64, 128])
        dy = TensorDescriptor.from_tensor(v.view(NT, E), [64, 64])

        def walk_lib_tma():
            chunk_state_kernel[(triton.cdiv(S, 128) * triton.cdiv(E, 64), NSEG, 1)](
                kl, v, dx, dy, hout, tot, tot, ones, seg_first, seg_n, seg_seq, ch_start, ch_len, S, E, 1,
                BS=128, BE=64, BT=64, REVERSE=False, STORE=True, HAS_INIT=False, PREC="tf32", TMA=True,
                num_warps=4, num_stages=stages)

        t = bench(walk_lib_tma)
        row(f"walk lib TMA bs128 be64 bt64 w4 s{stages}", t,
            max((hout.float() - h_ref.float()).abs().max().item(), (tot - tot_ref).abs().max().item()))
    for bs, be, bt, warps, stages, ws in (
        (128, 64, 64, 4, 3, False),
        (128, 64, 64, 4, 4, False),
    ):
        name = f"walk tma bs{bs} be{be} bt{bt} w{warps} s{stages}{' ws' if ws else ''}"
        try:
            hout = torch.empty_like(h_ref)
            tot = torch.empty_like(tot_ref)
            d_x = TensorDescriptor.from_tensor(kl.view(NT, S), [bt, bs])
            d_y = TensorDescriptor.from_tensor(v.view(NT, E), [bt, be])

            def fn():
                walk_tma_kernel[(triton.cdiv(S, bs) * triton.cdiv(E, be), NSEG)](
                    d_x, d_y, hout, tot, S, E, C, NCS, BS=bs, BE=be, BT=bt, WS=ws,
                    num_warps=warps, num_stages=stages)

            t = bench(fn)
            err = max((hout.float() - h_ref.float()).abs().max().item(), (tot - tot_ref).abs().max().item())
            row(name, t, err)
        except Exception as exc:
            traceback.print_exc(limit=2)
            row(name, None, None, f"{type(exc).__name__}: {str(exc)[:200]}")

    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "exp_tma_mixed_chunk.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
