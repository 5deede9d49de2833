"""Host (CPU) time of eager Triton-op calls with no-op kernels.

Every Triton kernel of ``lintime.ops.*.triton`` and ``lintime.ops.state_passing`` is replaced by
a stub whose launch does nothing, so what is timed is the host side of a call: Python, the torch
dispatcher, custom-op / autograd machinery, allocations and launch arithmetic -- not Triton's
own launcher (argument binding), which the stub skips.  Tensors live on the CPU
(``TRITON_INTERPRET=1`` only lets them past the device check); ``sm_count`` answers 132 (H200)
and the GPU block sizes are used, so the launch plans are those of the GPU.  CPU tensors make
fills (``zeros``) and dtype conversions cost CPU memory bandwidth that a GPU would spend on the
device instead; the ops avoid them on the eager path where they can.

    TRITON_INTERPRET=1 python3 benchmarks/host_time.py [--repeats 7] [--iters 20] [--ops linear,mixed_chunk,gau,gla]

Prints, per op, the median over repeats of the mean host time of one eager forward and one
eager forward + backward (ms), and the (min-max) of the repeats.

Shapes: the benchmark shapes by default (linear / GLA B4 T8k H16 D64; mixed chunk and GAU B4
T8k H1 S128 E2048, C256).  Zero fills and dtype conversions of tensors this large cost the CPU
milliseconds of memory bandwidth and page faults (noisy on a shared machine) that a GPU spends
as device work, one launch each; ``--small`` times shapes with the same launch sequence (same
segment / plan structure) whose buffers are small, which isolates the host time proper:
linear / GLA B1 T2k H1 D64, mixed chunk and GAU B1 T1k H1 S128 E64.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

MODULES = [
    "lintime.ops.segments",
    "lintime.ops.state_passing",
    "lintime.ops.linear.triton.ops",
    "lintime.ops.gla.triton.ops",
    "lintime.ops.mixed_chunk.triton.mixed_chunk",
    "lintime.ops.gau.triton.gau",
]


class _NoOpKernel:
    def __getitem__(self, grid):
        return _noop


def _noop(*args, **kwargs):
    return None


def stub_kernels() -> int:
    """Replace every Triton kernel object in :data:`MODULES` by a no-op; returns how many."""
    from triton.runtime.jit import (
        KernelInterface,  # JITFunction, InterpretedFunction, Autotuner
    )

    kinds = (KernelInterface,)
    n = 0
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, val in list(vars(mod).items()):
            if isinstance(val, kinds):
                setattr(mod, attr, _NoOpKernel())
                n += 1
    tc = importlib.import_module("lintime.ops.kernel_launch")
    tc._sm_count = lambda index: 132
    tc.sm_count = lambda device: 132
    for name in MODULES:  # modules that imported sm_count by name
        mod = importlib.import_module(name)
        if hasattr(mod, "sm_count"):
            mod.sm_count = tc.sm_count
    return n


SMALL = False


def _linear(dtype):
    from lintime.ops.linear.triton.ops import triton_linear_attention

    B, T, H, D = (1, 2048, 1, 64) if SMALL else (4, 8192, 16, 64)
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype) for _ in range(3))
    do = torch.randn(B, T, H, D, dtype=dtype)

    def fwd(grad):
        xs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        o, _ = triton_linear_attention(*xs)
        return o, xs

    return fwd, do


def _gla(dtype):
    from lintime.ops.gla.triton.ops import triton_gla

    B, T, H, D = (1, 2048, 1, 64) if SMALL else (4, 8192, 16, 64)
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype) for _ in range(3))
    g = -torch.rand(B, T, H, D, dtype=torch.float32)
    do = torch.randn(B, T, H, D, dtype=dtype)

    def fwd(grad):
        xs = [x.detach().requires_grad_(grad) for x in (q, k, v, g)]
        o, _ = triton_gla(*xs)
        return o, xs

    return fwd, do


def _mixed_chunk(dtype):
    from lintime.ops.gau.triton.plan import Blocks
    from lintime.ops.mixed_chunk.triton.mixed_chunk import triton_mixed_chunk_attention

    B, T, H, S, E, C = (1, 1024, 1, 128, 64, 256) if SMALL else (4, 8192, 1, 128, 2048, 256)
    qs = [torch.randn(B, T, H, S, dtype=dtype) for _ in range(4)]
    v = torch.randn(B, T, H, E, dtype=dtype)
    do = torch.randn(B, T, H, E, dtype=dtype)
    blocks = Blocks(bg=128, stages=3, bs_state=128, bs_gau=128)  # default_blocks on a GPU

    def fwd(grad):
        xs = [x.detach().requires_grad_(grad) for x in (*qs, v)]
        o, _ = triton_mixed_chunk_attention(*xs, chunk_size=C, blocks=blocks)
        return o, xs

    return fwd, do


def _gau(dtype):
    from lintime.ops.gau.triton.gau import triton_gau_attention
    from lintime.ops.gau.triton.plan import Blocks

    B, T, H, S, E = (1, 1024, 1, 128, 64) if SMALL else (4, 8192, 1, 128, 2048)
    q, k = (torch.randn(B, T, H, S, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, E, dtype=dtype)
    do = torch.randn(B, T, H, E, dtype=dtype)
    blocks = Blocks(be_fwd=256, warps_gau_fwd=8, bs_gau=128)  # default_blocks on a GPU

    def fwd(grad):
        xs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        o = triton_gau_attention(*xs, scale=1.0 / T, blocks=blocks)
        return o, xs

    return fwd, do


CASES = {"linear": _linear, "mixed_chunk": _mixed_chunk, "gau": _gau, "gla": _gla}


def measure(name: str, repeats: int, iters: int, dtype=torch.bfloat16) -> dict:
    fwd, do = CASES[name](dtype)

    def run_fwd():
        with torch.no_grad():
            fwd(False)

    def run_fwdbwd():
        o, _ = fwd(True)
        torch.autograd.backward(o, do)

    out = {}
    for label, fn in (("fwd", run_fwd), ("fwd+bwd", run_fwdbwd)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters * 1e3)
        out[label] = (statistics.median(times), min(times), max(times))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ops", default="linear,mixed_chunk,gau,gla")
    ap.add_argument("--small", action="store_true", help="same launch sequence, small buffers")
    args = ap.parse_args(argv)
    global SMALL
    SMALL = args.small
    n = stub_kernels()
    print(f"{n} kernels stubbed; torch {torch.__version__}, triton {triton.__version__}; ms per call, "
          f"median (min-max) of {args.repeats} repeats x {args.iters} calls")
    for name in args.ops.split(","):
        r = measure(name, args.repeats, args.iters)
        print(f"{name:12s} " + "  ".join(f"{k} {m:.3f} ({lo:.3f}-{hi:.3f})" for k, (m, lo, hi) in r.items()),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
