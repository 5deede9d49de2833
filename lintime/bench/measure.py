"""Timing and environment helpers shared by the bench cases (CUDA only).

Every time is the median of ``triton.testing.do_bench`` (CUDA events around each call, warm-up
first, a flush of the L2 cache between calls), after two untimed calls that keep compilation and
autotuning out of its run-count estimate.  Peaks are measured on the machine, not copied from a
datasheet: a large device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul on
random data (METHOD.md).
"""

from __future__ import annotations

import platform
import time

import torch


def median_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    import triton

    fn()
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def fwd_fwdbwd_ms(f, inputs: list, *, rep: int = 100) -> tuple[float, float]:
    """Median times of ``f(*inputs)`` without autograd, and of the forward plus the gradients of
    every input that requires them (first output, a fixed random output gradient)."""

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    def fwd():
        with torch.no_grad():
            f(*inputs)

    out = first(f(*inputs))
    do = torch.randn_like(out)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwdbwd():
        torch.autograd.grad(first(f(*inputs)), leaves, do)

    return median_ms(fwd, rep=rep), median_ms(fwdbwd, rep=rep)


def graph_ms(fn, rep: int = 100) -> float | None:
    """Median device time of ``fn`` replayed from a CUDA graph: the launch overhead of the host
    (Python, the dispatcher, Triton's launcher) is gone, what remains is the GPU's work and the
    gaps between dependent kernels.  ``None`` when ``fn`` cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay, rep=rep)
    except Exception as e:  # capture is best effort: report the eager time only
        print(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None


def fwd_fwdbwd_graph_ms(f, inputs: list, *, rep: int = 100) -> tuple[float | None, float | None]:
    """:func:`fwd_fwdbwd_ms` replayed from CUDA graphs (device time)."""

    def first(out):
        return out[0] if isinstance(out, (tuple, list)) else out

    def fwd():
        with torch.no_grad():
            f(*inputs)

    do = torch.randn_like(first(f(*inputs)))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwdbwd():
        torch.autograd.grad(first(f(*inputs)), leaves, do)

    return graph_ms(fwd, rep=rep), graph_ms(fwdbwd, rep=rep)


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ b, warmup=20, rep=100) / 1e9


def copy_peak_gbps(n_bytes: int = 2 << 30) -> float:
    x = torch.randn(n_bytes // 4, device="cuda")
    y = torch.empty_like(x)
    return 2 * n_bytes / median_ms(lambda: y.copy_(x), warmup=10, rep=50) / 1e6


def environment(peaks: bool = True) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    env = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    try:
        import fla

        env["fla"] = getattr(fla, "__version__", "installed")
    except ImportError:
        env["fla"] = None
    if peaks:
        env["matmul_bf16_tflops"] = matmul_peak_tflops()
        env["copy_gbps"] = copy_peak_gbps()
    return env
