"""Fused linear + cross-entropy against the plain loss: forward + backward time and peak memory.

    python lab/bench_cross_entropy.py [--N 32768 --V 32000 --d 768 --dtype bf16 --chunk-size C]

Setting of a training step under bf16 autocast: ``x [N, d]`` hidden states in ``dtype`` (requires
grad), ``W [V, d]`` an fp32 parameter, summed loss.  Rows:

* ``plain``: ``F.cross_entropy(F.linear(x, W).float(), y, reduction="sum")`` under autocast (the
  model's ``fused_loss=False`` path);
* ``fused-chunk`` / ``fused-triton``: ``linear_cross_entropy(x, W, y, reduction="sum")`` with the
  PyTorch / Triton per-row step.

Time: median of ``--reps`` CUDA-event-timed fwd+bwd calls after warm-up.  Memory: peak allocated
during one fwd+bwd minus what was allocated before it (so it counts the new ``x.grad`` and
``W.grad``, the same in every row).  ``rel_diff``: relative RMS difference from the plain row.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from lintime.modules.cross_entropy import linear_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=32768)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), DTYPES[args.dtype]
    torch.manual_seed(0)
    x = torch.randn(args.N, args.d, device=dev, dtype=dt).requires_grad_()
    w = (torch.randn(args.V, args.d, device=dev) * args.d**-0.5).requires_grad_()
    y = torch.randint(0, args.V, (args.N,), device=dev)
    y[::97] = -100

    def plain():
        with torch.autocast("cuda", dtype=dt, enabled=dt != torch.float32):
            logits = F.linear(x, w)
        return F.cross_entropy(logits.float(), y, reduction="sum")

    def fused(backend):
        return lambda: linear_cross_entropy(x, w, y, reduction="sum", chunk_size=args.chunk_size, backend=backend)

    results, ref = [], None
    for name, fn in [("plain", plain), ("fused-chunk", fused("chunk")), ("fused-triton", fused("triton"))]:
        def step():
            x.grad = w.grad = None
            loss = fn()
            loss.backward()
            return loss

        for _ in range(args.warmup):
            loss = step()
        grads = (loss.detach().double(), x.grad.double(), w.grad.double())
        ms = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        x.grad = w.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        row = dict(name=name, N=args.N, V=args.V, d=args.d, dtype=args.dtype, ms=round(statistics.median(ms), 3),
                   peak_mib=round(peak / 2**20, 1), device=torch.cuda.get_device_name())
        if ref is None:
            ref = grads
        else:  # relative RMS difference from the plain path (both in the same dtype)
            row["rel_diff"] = {k: float((a - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt())
                               for k, a, r in zip(("loss", "dx", "dW"), grads, ref)}
        results.append(row)
        print(json.dumps(row), flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"{r['name']}: {base['ms'] / r['ms']:.2f}x the plain speed, {r['peak_mib'] / base['peak_mib']:.3f}x its peak memory")


if __name__ == "__main__":
    main()
