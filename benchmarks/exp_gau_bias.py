"""Experiment (issue #5): what GAU's Toeplitz bias costs -- CUDA-graph fwd / fwd+bwd at T = 4k, B = 8, S = 128,
E = 2048 bf16 without a bias, with a bias that needs no gradient, and with its gradient (the bench's case), plus
per-kernel device times of the last two (torch.profiler).

Usage (GPU): ``PYTHONPATH=$PWD python3 benchmarks/exp_gau_bias.py [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lintime.bench.measure import fwd_fwdbwd_graph_ms, git_commit
from lintime.ops.gau.triton import triton_gau_attention


def kernels(f, inputs):
    out = f(*inputs)
    do = torch.randn_like(out)
    leaves = [x for x in inputs if x.requires_grad]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(f(*inputs), leaves, do)
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rows[ev.key[:60]] = round(ev.device_time_total / 5 / 1000, 4)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, T, S, E = 8, 4096, 128, 2048
    bf = torch.bfloat16
    q = (torch.randn(B, T, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
    k = (torch.randn(B, T, 1, S, device="cuda", dtype=bf) * 0.5).requires_grad_()
    v = torch.randn(B, T, 1, E, device="cuda", dtype=bf).requires_grad_()
    rb = (torch.randn(1, 2 * T - 1, device="cuda", dtype=bf) * 0.1)
    rows = []
    for name, bias in (("no_bias", None), ("bias_no_grad", rb), ("bias_grad", rb.clone().requires_grad_())):
        inputs = [q, k, v] + ([bias] if bias is not None else [])

        def f(*a):
            return triton_gau_attention(a[0], a[1], a[2], rel_bias=a[3] if len(a) > 3 else None, scale=1.0 / S)

        fwd, fb = fwd_fwdbwd_graph_ms(f, inputs, rep=30)
        row = {"name": name, "fwd_graph_ms": fwd, "fwdbwd_graph_ms": fb, "kernels": kernels(f, inputs)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"env": {"device": torch.cuda.get_device_name(), "git_commit": git_commit(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                       "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
