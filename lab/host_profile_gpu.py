"""Where the host time of eager Triton-op calls goes, on a GPU machine (the launcher included):
cProfile over ``--iters`` eager forward + backward calls of each op at the benchmark shapes, after a
warm-up (compilation excluded), one ``torch.cuda.synchronize()`` at the end.  Prints per op the wall
time per call, the device-free host estimate and the top functions by own time.

    python3 lab/host_profile_gpu.py [--iters 50] [--ops linear,gla,mixed_chunk] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F


def _case(op: str):
    dev, bf = "cuda", torch.bfloat16
    if op in ("linear", "linear_plain"):
        from lintime.ops import linear_attention

        B, T, H, D = 4, 8192, 16, 64
        xs = [torch.rand(B, T, H, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3)]  # as the bench
        norm = op == "linear"
        return xs, lambda q, k, v: linear_attention(q, k, v, normalize=norm, backend="triton")[0]
    if op == "gla":
        from lintime.ops import gated_linear_attention

        B, T, H, K, V = 4, 8192, 4, 128, 256
        q, k = (torch.randn(B, T, H, K, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        v = torch.randn(B, T, H, V, device=dev, dtype=bf, requires_grad=True)
        g = (F.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16).to(bf).requires_grad_()
        return [q, k, v, g], lambda q, k, v, g: gated_linear_attention(q, k, v, g, backend="triton")[0]
    if op == "mixed_chunk":
        from lintime.ops import mixed_chunk_attention

        B, T, S, E, C = 1, 32768, 128, 2048, 256
        xs = [(0.5 * torch.randn(B, T, 1, S, device=dev)).to(bf).requires_grad_() for _ in range(4)]
        xs.append(torch.randn(B, T, 1, E, device=dev, dtype=bf, requires_grad=True))
        xs.append((0.1 * torch.randn(1, 2 * C - 1, device=dev)).requires_grad_())
        return xs, lambda *a: mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, backend="triton")[0]
    raise ValueError(op)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ops", default="linear,linear_plain,gla,mixed_chunk")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for op in a.ops.split(","):
        xs, f = _case(op)
        do = torch.randn_like(f(*xs))

        def step(f=f, xs=xs, do=do):
            torch.autograd.backward(f(*xs), do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step()
        t_host = time.perf_counter() - t0  # host time to issue the calls (device may lag behind)
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"== {op}: {1e3 * t_host / a.iters:.3f} ms host per fwd+bwd issued, {1e3 * t_all / a.iters:.3f} ms "
              f"per fwd+bwd with the device", flush=True)
        print("\n".join(s.getvalue().splitlines()[:a.top + 12]), flush=True)
        del xs, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
