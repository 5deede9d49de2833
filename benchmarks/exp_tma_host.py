"""Experiment (session 7): host time of eager mixed chunk fwd+bwd with and without TMA descriptors.

    PYTHONPATH=. python3 benchmarks/exp_tma_host.py
"""

import cProfile
import dataclasses
import pstats
import time

import torch

from lintime.ops.gau.triton.plan import default_blocks
from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

B, T, H, S, E, C = 16, 2048, 1, 128, 2048, 256
dt = torch.bfloat16
xs = [torch.randn(B, T, H, S, device="cuda", dtype=dt, requires_grad=True) for _ in range(4)]
xs.append(torch.randn(B, T, H, E, device="cuda", dtype=dt, requires_grad=True))
do = torch.randn(B, T, H, E, device="cuda", dtype=dt)
base = default_blocks(S, E, dt, C)


def step(blocks):
    o, _ = triton_mixed_chunk_attention(*xs, chunk_size=C, blocks=blocks)
    o.backward(do)


for tma in (1, 0, 1, 0):
    blocks = dataclasses.replace(base, tma=tma)
    for _ in range(3):
        step(blocks)
    torch.cuda.synchronize()
    n = 30
    t0 = time.perf_counter()
    for _ in range(n):
        step(blocks)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"tma={tma}: host {1e3 * (t1 - t0) / n:.3f} ms/iter (queued), wall {1e3 * (t2 - t0) / n:.3f} ms/iter",
          flush=True)

blocks = dataclasses.replace(base, tma=1)
pr = cProfile.Profile()
pr.enable()
for _ in range(20):
    step(blocks)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
