"""Experiment (issue #5, GAU target): how fast could GAU be if its scores were materialised by query slabs?

Today's GAU kernels are FlashAttention-shaped (no scores in memory): with ``E = 2048`` the output tile of a
query block does not fit on chip, so each program keeps a ``[64, 512]`` accumulator and re-streams ``v`` tiles
from L2 for every 64 query rows (about 80 KB per 2.6 M MACs), and the scores are recomputed per E tile.  The
alternative measured here writes ``relu(s)^2`` for a slab of query rows (memory ``R x T`` per sequence, linear
in ``T`` for a fixed slab height ``R``) and runs the ``E``-wide products as long-K GEMMs (cuBLAS here).

This is a PyTorch prototype, not a kernel: block-causal (query block ``i`` of ``NB`` sees keys ``[0, (i + 1) T /
NB)``, the diagonal block masked), no Toeplitz bias, elementwise passes unfused, autograd saving every
intermediate.  A fused version would only be faster.  Prints and writes (``--out``) CUDA-graph medians of
forward and forward + backward at ``T = 4096, B = 8, S = 128, E = 2048`` bf16 next to SDPA (H16 D64) and the
Triton GAU kernels of the same call.

Usage (GPU): ``PYTHONPATH=$PWD python3 benchmarks/exp_gau_slab.py --out $OUT/exp_gau_slab.json``
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from lintime.bench.measure import fwd_fwdbwd_graph_ms, git_commit


def gau_slab(q, k, v, scale: float, nb: int):
    """Block-causal relu^2 attention by ``nb`` query slabs with materialised scores (``[B, T, S]`` q / k,
    ``[B, T, E]`` v)."""
    T = q.shape[1]
    R = T // nb
    outs = []
    tri = torch.ones(R, R, dtype=torch.bool, device=q.device).tril()
    for i in range(nb):
        lo, hi = i * R, (i + 1) * R
        s = torch.bmm(q[:, lo:hi], k[:, :hi].transpose(1, 2)) * scale  # [B, R, hi]
        p = F.relu(s).square()
        diag = p[:, :, lo:hi].masked_fill(~tri, 0.0)
        p = torch.cat([p[:, :, :lo], diag], dim=2)
        outs.append(torch.bmm(p, v[:, :hi]))
    return torch.cat(outs, dim=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768)
    args = ap.parse_args()
    T = args.T
    B = max(1, args.tokens // T)
    S, E = 128, 2048
    dev = "cuda"
    bf = torch.bfloat16
    torch.manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=bf) * scale).requires_grad_()

    q, k, v = leaf(B, T, S, scale=0.5), leaf(B, T, S, scale=0.5), leaf(B, T, E)
    rows = []

    def record(name, f, inputs, **extra):
        fwd, fb = fwd_fwdbwd_graph_ms(f, inputs, rep=30)
        rows.append({"name": name, "fwd_graph_ms": fwd, "fwdbwd_graph_ms": fb, **extra})
        print(f"{name:24s} fwd {fwd}  fwd+bwd {fb} ms", flush=True)

    qs, ks, vs = leaf(B, 16, T, 64), leaf(B, 16, T, 64), leaf(B, 16, T, 64)
    record("sdpa_h16_d64", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), [qs, ks, vs])
    del qs, ks, vs

    from lintime.ops.gau.triton import triton_gau_attention

    q4, k4, v4 = (x.detach()[:, :, None].clone().requires_grad_() for x in (q, k, v))
    record("gau_triton", lambda a, b, c: triton_gau_attention(a, b, c, scale=1.0 / S), [q4, k4, v4])
    del q4, k4, v4
    for nb in (1, 2, 4, 8):
        torch.cuda.empty_cache()
        try:
            record(f"slab_prototype_nb{nb}", lambda a, b, c, _nb=nb: gau_slab(a, b, c, 1.0 / S, _nb), [q, k, v],
                   causal_fraction=(nb + 1) / (2 * nb))
        except torch.OutOfMemoryError as e:  # the prototype keeps every intermediate for autograd
            print(f"slab_prototype_nb{nb}: out of memory ({str(e)[:80]})", flush=True)
    # the GEMMs alone: what a fused slab kernel's products would take (block-causal, nb = 8)
    with torch.no_grad():
        nb = 8
        R = T // nb
        p_full = torch.rand(B, T, T, device=dev, dtype=bf)
        vv = v.detach()

        def gemms():
            for i in range(nb):
                torch.bmm(p_full[:, i * R:(i + 1) * R, :(i + 1) * R], vv[:, :(i + 1) * R])

        from lintime.bench.measure import graph_ms

        ms = graph_ms(gemms, rep=30)
        flops = 2 * B * E * sum(R * (i + 1) * R for i in range(nb))
        rows.append({"name": "pv_gemms_only_nb8", "graph_ms": ms, "tflops": flops / ms / 1e9 if ms else None})
        print(f"pv_gemms_only_nb8        {ms} ms  ({flops / ms / 1e9 if ms else float('nan'):.0f} TFLOP/s)", flush=True)
    res = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "git_commit": git_commit()},
           "shape": {"B": B, "T": T, "S": S, "E": E, "dtype": "bf16"}, "results": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
