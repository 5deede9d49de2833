"""Mixed chunk attention: the default launch against named alternatives, interleaved over several rounds.

One CUDA-graph fwd+bwd median per (round, length, variant), the variants of a length timed one after the other in
every round, so slow drifts of the GPU (clocks, memory placement) hit them alike; the summary gives each variant's
median over the rounds, its spread, and its ratio to the first variant named (`default` first, as usual).  Single
runs of `lintime bench ops --cases flash.variants` moved by up to ~7 % between calls at one length (H200, 2026-11-26);
this is how session 12 checked its changes.

    PYTHONPATH=$PWD python3 benchmarks/ab_mixed_chunk_rounds.py --Ts 2048,4096,8192,16384,32768 --rounds 5 \
        --variants default,s11,flat_bs128 [--out results.json]

``--eager`` times eager calls instead (host-bound at these sizes; session 13 found such A/Bs dominated by noise: the
same code read up to 12 % apart).

Variants: ``default`` (the blocks a call gets), ``s11`` (session 11's walk: one loop per chunk, the state tile
never thinned), ``flat_bs128`` (the default walk, the state tile never thinned), or any name of
``LAUNCH_VARIANTS``.  bf16, S = 128, E = 2048, C = 256, H = 1, 32k tokens per batch, with the Toeplitz bias.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--Ts", default="2048,4096,8192,16384,32768")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep", type=int, default=30, help="graph replays per median")
    p.add_argument("--variants", default="default,s11,flat_bs128")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out", default=None)
    p.add_argument("--eager", action="store_true",
                   help="eager calls (host and launch overhead included; do_bench medians, L2 flushed) instead of "
                        "CUDA-graph replays")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from lintime.bench.measure import fwd_fwdbwd_graph_ms, fwd_fwdbwd_ms
    from lintime.ops.gau.triton.plan import default_blocks, variant_blocks
    from lintime.ops.mixed_chunk.triton import mixed_chunk as mc
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

    S, E, C, dt = 128, 2048, 256, torch.bfloat16
    dev = torch.device("cuda")
    base = default_blocks(S, E, dt, C)
    names = [n for n in a.variants.split(",") if n]
    Ts = [int(t) for t in a.Ts.split(",") if t]

    def blocks_for(name, B, T):
        if name == "default":
            return base
        old_seg = mc._seg_chunks(B, T, 1, S, E, C, None, base, dev)  # the segments of the [128, E] walk tiles
        if name == "s11":
            return dataclasses.replace(base, walk_flat=0, seg_chunks=old_seg)
        if name == "flat_bs128":
            return dataclasses.replace(base, seg_chunks=old_seg)
        return variant_blocks(dict(mc.LAUNCH_VARIANTS)[name], S, E, dt, C)

    torch.manual_seed(0)
    cases = []
    for T in Ts:
        B = max(1, a.tokens // T)
        xs = [(torch.randn(B, T, 1, S, device=dev) * 0.5).to(dt).requires_grad_() for _ in range(4)]
        xs += [torch.randn(B, T, 1, E, device=dev).to(dt).requires_grad_(),
               (torch.randn(1, 2 * C - 1, device=dev) * 0.1).to(dt).requires_grad_()]
        for name in names:
            blk = blocks_for(name, B, T)

            def f(*x, _b=blk):
                return triton_mixed_chunk_attention(*x[:5], rel_bias=x[5], chunk_size=C, blocks=_b)[0]

            cases.append((T, B, name, f, xs))
    times: dict = {(T, n): [] for T, _, n, _, _ in cases}
    for r in range(a.rounds):
        for T, B, name, f, xs in cases:
            _, fb = (fwd_fwdbwd_ms if a.eager else fwd_fwdbwd_graph_ms)(f, xs, rep=a.rep)
            times[(T, name)].append(fb)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = []
    print(f"{'T':>6s} {'variant':12s} {'median':>8s} {'min':>8s} {'max':>8s} {'vs ' + names[0]:>10s}")
    for T in Ts:
        ref = statistics.median(times[(T, names[0])])
        for n in names:
            t = times[(T, n)]
            med = statistics.median(t)
            rows.append({"T": T, "variant": n, "fwdbwd_eager_ms" if a.eager else "fwdbwd_graph_ms": t, "median_ms": med})
            print(f"{T:6d} {n:12s} {med:8.4f} {min(t):8.4f} {max(t):8.4f} {med / ref:10.3f}")
    if a.out:
        from lintime.bench.measure import environment

        with open(a.out, "w") as fh:
            json.dump({"env": environment(peaks=False), "rounds": a.rounds, "rep": a.rep,
                       "shape": {"S": S, "E": E, "C": C, "H": 1}, "rows": rows}, fh, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
