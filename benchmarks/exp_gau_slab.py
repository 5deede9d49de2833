"""Experiment (issue #5, GAU target): GAU's slab path (:mod:`lintime.ops.gau.triton.slab`) against its tiled
FlashAttention-shaped kernels and SDPA, in one call.

1. Correctness at GAU's real shape (``H = 1, S = 128, E = 2048``, T = 1100 and 700, B = 2, Toeplitz bias,
   causal and not): every slab variant named below, bf16 by the half-precision rule of ``lintime.testing``
   against the fp64 naive form (output and the gradients of q, k, v and the bias); a failure is printed and
   makes the exit code 1.
2. CUDA-graph device time, fwd and fwd+bwd, bf16, 32k tokens per batch, at T = 2k / 4k / 8k (or ``--Ts``):
   SDPA causal ``H16 D64``, the tiled kernels (``slab = 0``) and each slab variant (the bias and its gradient
   included, like ``lintime bench ops --cases flash.graph``).

Writes ``$OUT/exp_gau_slab.json`` (or ``--out``).  Usage (GPU):
``OUT=. PYTHONPATH=$PWD python3 benchmarks/exp_gau_slab.py [--Ts 2048,4096,8192] [--variants slab512,...]``.
(The session-9 PyTorch prototype this replaces -- unfused elementwise passes, 1.19 / 4.15 ms at 4k -- is in git
history, commit 9bc2246.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from lintime.bench.measure import fwd_fwdbwd_graph_ms, git_commit
from lintime.ops import gau_attention
from lintime.ops.gau.triton import triton_gau_attention
from lintime.ops.gau.triton.gau import LAUNCH_VARIANTS
from lintime.ops.gau.triton.plan import variant_blocks
from lintime.testing import assert_half_rule


def check(blocks, name, causal, T=1100, B=2, S=128, E=2048):
    g = torch.Generator().manual_seed(T)
    q, k = (0.5 * torch.randn(B, T, 1, S, generator=g, dtype=torch.float64) for _ in range(2))
    v, do = (torch.randn(B, T, 1, E, generator=g, dtype=torch.float64) for _ in range(2))
    b = 0.5 * torch.randn(1, 2 * T - 1, generator=g, dtype=torch.float64)
    xs64 = [x.cuda() for x in (q, k, v, b, do)]

    def run(xs, triton):
        leaves = [x.detach().clone().requires_grad_() for x in xs[:4]]
        if triton:
            o = triton_gau_attention(*leaves[:3], rel_bias=leaves[3], scale=1 / S, causal=causal, blocks=blocks)
        else:
            o = gau_attention(*leaves[:3], rel_bias=leaves[3], scale=1 / S, causal=causal, backend="naive")
        return [o, *torch.autograd.grad(o, leaves, xs[4])]

    ref = run(xs64, False)
    xs = [x.bfloat16() for x in xs64]
    base, out = run(xs, False), run(xs, True)
    bad = []
    for n, r, o, bb in zip(("o", "dq", "dk", "dv", "db"), ref, out, base):
        try:
            assert_half_rule(f"{name} causal={causal} T={T} {n}", r, o, bb)
        except AssertionError as e:
            bad.append(str(e))
    return bad


def packed_rows(Ts, S, E, tokens=32768):
    """Packed batches (``[1, 32k]`` with ``cu_seqlens``, rows of ``T`` tokens): ``mixed`` -- like ``lintime
    train``'s, three quarters of the rows one document each, a quarter three documents --, ``uniform`` -- every
    row one document (``lintime bench model``'s batches) -- and ``short`` -- eight documents a row.  The default,
    the default without masked rows (``slab_masked = 0``) and the tiled kernels alone, eager fwd+bwd (packed calls
    read ``cu_seqlens`` on the host: no CUDA graph), bias with its gradient."""
    from lintime.bench.measure import fwd_fwdbwd_ms

    bf, out = torch.bfloat16, []
    for T, layout in ((T, layout) for T in Ts for layout in ("mixed", "uniform", "short")):
        n_rows = tokens // T
        lens = []
        for r in range(n_rows):
            if layout == "short":  # every row eight documents
                lens += [T // 8] * 7 + [T - 7 * (T // 8)]
            else:
                lens += [T] if (r % 4 or layout == "uniform") else [T // 2, T // 3, T - T // 2 - T // 3]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        TT = sum(lens)
        q = (torch.randn(1, TT, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
        k = (torch.randn(1, TT, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
        v = torch.randn(1, TT, 1, E, device="cuda", dtype=bf).requires_grad_()
        rb = (torch.randn(1, 2 * TT - 1, device="cuda", dtype=bf) * 0.1).requires_grad_()
        # default: mixed / short rows by the masked slab path where its work rule says so (session 11), one-length
        # calls as an [n, L] batch; "unmasked": the default before (mixed lengths to the tiled kernels)
        impls = (("default", {}), ("unmasked", {"slab_masked": 0}), ("tiled", {"slab": 0}))
        for name, o in impls[::2] if layout == "uniform" else impls:
            blocks = variant_blocks(o, S, E, bf)

            def f(a, b, c, d, _b=blocks):
                return triton_gau_attention(a, b, c, rel_bias=d, scale=1 / S, cu_seqlens=cu, blocks=_b)

            e = fwd_fwdbwd_ms(f, [q, k, v, rb], rep=30)
            out.append({"T": T, "packed": layout, "n_seqs": len(lens), "impl": name,
                        "fwd_eager_ms": e[0], "fwdbwd_eager_ms": e[1]})
            print(out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "exp_gau_slab.json"))
    ap.add_argument("--Ts", default="2048,4096,8192")
    ap.add_argument("--variants", default="", help="comma-separated names of LAUNCH_VARIANTS (default: every "
                                                   "variant whose name starts with 'slab' or is 'tiled')")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--packed", action="store_true", help="also time packed batches (packed_rows)")
    ap.add_argument("--skip-unpacked", action="store_true")
    ap.add_argument("--bias", default="grad", help="comma-separated: grad (bias with its gradient, the default), "
                                                   "nograd (bias, no gradient), none (no bias)")
    args = ap.parse_args()
    S, E, bf = 128, 2048, torch.bfloat16
    want = [n for n in args.variants.split(",") if n]
    variants = [(n, o) for n, o in LAUNCH_VARIANTS if (n in want if want else (n.startswith("slab") or n == "tiled"))]
    variants = [("default", {})] + variants
    failures = []
    if not args.no_check:
        for name, o in variants:
            blocks = variant_blocks(o, S, E, bf)
            for causal in (True, False):
                bad = check(blocks, name, causal, T=1100 if causal else 700)
                print(f"check {name:14s} causal={causal}: {'ok' if not bad else 'FAILED'}", flush=True)
                failures += bad
        for f in failures:
            print(f, flush=True)
    rows = []
    for T in ([] if args.skip_unpacked else [int(t) for t in args.Ts.split(",")]):
        B = max(1, 32768 // T)
        qs, ks, vs = [torch.randn(B, 16, T, 64, device="cuda", dtype=bf).requires_grad_() for _ in range(3)]
        s = fwd_fwdbwd_graph_ms(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                                [qs, ks, vs], rep=30)
        del qs, ks, vs
        rows.append({"T": T, "B": B, "impl": "sdpa_h16_d64", "fwd_ms": s[0], "fwdbwd_ms": s[1]})
        print(rows[-1], flush=True)
        q = (torch.randn(B, T, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
        k = (torch.randn(B, T, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
        v = torch.randn(B, T, 1, E, device="cuda", dtype=bf).requires_grad_()
        rb = (torch.randn(1, 2 * T - 1, device="cuda", dtype=bf) * 0.1).requires_grad_()
        for (name, o), bias in ((v_, b_) for v_ in variants for b_ in args.bias.split(",")):
            blocks = variant_blocks(o, S, E, bf)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            rb_ = {"grad": rb, "nograd": rb.detach(), "none": None}[bias]
            g = fwd_fwdbwd_graph_ms(lambda a, b, c, d=None, _b=blocks: triton_gau_attention(
                a, b, c, rel_bias=d, scale=1 / S, blocks=_b), [q, k, v] + ([rb_] if rb_ is not None else []), rep=30)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows.append({"T": T, "B": B, "impl": name, "bias": bias, "blocks": dataclasses.asdict(blocks),
                         "fwd_ms": g[0],
                         "fwdbwd_ms": g[1], "ratio_to_sdpa": (g[1] / s[1]) if g[1] and s[1] else None,
                         "peak_mib_above_inputs": peak})
            print({k_: v_ for k_, v_ in rows[-1].items() if k_ != "blocks"}, flush=True)
        del q, k, v, rb
        torch.cuda.empty_cache()
    if args.packed:
        rows += packed_rows([int(t) for t in args.Ts.split(",")], S, E)
    res = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "git_commit": git_commit()},
           "failures": failures, "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
