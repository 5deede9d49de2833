"""Per-kernel device time of one FLASH layer forward + backward (d = 1024, bf16, 32k tokens) on a GPU,
grouped into projections (cuBLAS GEMMs), mixed chunk attention, the gau_heads prologue and the rest.

Usage (GPU machine): ``PYTHONPATH=. python3 lab/profile_flash_layer.py [T]``.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from lintime.bench.cases_flash import flash_block
from lintime.layers.positional import token_positions


def profile_device(fn, n: int = 5, warmup: int = 1):
    """``torch.profiler`` over ``n`` calls of ``fn`` (CUDA activity only) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof


def main(T: int = 4096, d: int = 1024, tokens: int = 32768, n: int = 5) -> None:
    B = max(1, tokens // T)
    block = flash_block(d).cuda().to(torch.bfloat16)  # the block `lintime bench ops` times
    x = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = token_positions(B, T, device="cuda")
    g = torch.randn_like(x)

    def step():
        y = block(x, pos)
        y.backward(g)

    prof = profile_device(step, n, warmup=3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof_ops:
        step()
        torch.cuda.synchronize()
    groups: dict[str, float] = {}
    rows = []
    for ev in prof.key_averages():
        dt = (getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)) / n / 1000.0
        if dt <= 0:
            continue
        k = ev.key
        if k.startswith(("mc_", "chunk_state", "seg_fix", "seg_scan")):  # (mc_gemm_kernel: before "gemm")
            grp = "mixed chunk attention"
        elif any(s in k for s in ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet", "ampere")):
            grp = "projections (cuBLAS)"
        elif "heads" in k:
            grp = "gau_heads prologue"
        elif "layer_norm" in k.lower() or "LayerNorm" in k:
            grp = "LayerNorm"
        else:
            grp = "other elementwise / reductions"
        groups[grp] = groups.get(grp, 0.0) + dt
        rows.append((dt, k[:70], ev.count // n))
    total = sum(groups.values())
    print(f"FLASH layer d={d} T={T} B={B} bf16: device {total:.3f} ms per fwd+bwd")
    for grp, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:7.3f} ms  {100 * ms / total:5.1f} %  {grp}")
    print("kernels:")
    for dt, k, c in sorted(rows, reverse=True)[:25]:
        print(f"  {dt:7.3f} ms  x{c:<3d} {k}")
    print("PyTorch ops by their own device time (one step):")
    ops = []
    for ev in prof_ops.key_averages():
        dt = (getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)) / 1000.0
        if dt > 0 and ev.key.startswith("aten::"):
            ops.append((dt, ev.key, ev.count))
    for dt, k, c in sorted(ops, reverse=True)[:20]:
        print(f"  {dt:7.3f} ms  x{c:<3d} {k}")
    print("elementwise PyTorch ops by input shape (where the copies and fills come from):")
    shaped = []
    for ev in prof_ops.key_averages(group_by_input_shape=True):
        dt = (getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)) / 1000.0
        if dt > 0.002 and ev.key in ("aten::copy_", "aten::fill_", "aten::mul", "aten::add", "aten::add_",
                                     "aten::sum", "aten::zero_", "aten::clone", "aten::cat"):
            shaped.append((dt, ev.key, ev.count, str(ev.input_shapes)[:90]))
    for dt, k, c, shp in sorted(shaped, reverse=True)[:24]:
        print(f"  {dt:7.3f} ms  x{c:<3d} {k:14s} {shp}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
