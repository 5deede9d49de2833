"""Timing and environment helpers shared by the bench cases.

Op cases (CUDA only): every time is the median of ``triton.testing.do_bench`` (CUDA events around each call, warm-up
first, a flush of the L2 cache between calls), after two untimed calls that keep compilation and
autotuning out of its run-count estimate.  Peaks are measured on the machine, not copied from a
datasheet: a large device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul on
random data (:func:`copy_peak_gbps`, :func:`matmul_peak_tflops`).

Whole-model steps (:mod:`lintime.bench.model`, CPU or CUDA): :func:`call_times_ms` times each call
on its own (``do_bench`` does not fit a training step or a decoding step: it picks one run count
from a time estimate -- a single run for a long step -- gives no spread, and flushing L2 between
calls that long measures nothing); :func:`quantiles` summarises the list.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
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


def capture_graph(fn):
    """``fn`` called once, warmed up on a side stream, then captured into a CUDA graph: ``(graph, the outputs of the
    captured call)`` -- those live in the graph's memory pool and are rewritten by every ``graph.replay()``."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_ms(fn, rep: int = 100) -> float | None:
    """Median device time of ``fn`` replayed from a CUDA graph: the launch overhead of the host
    (Python, the dispatcher, Triton's launcher) is gone, what remains is the GPU's work and the
    gaps between dependent kernels.  ``None`` when ``fn`` cannot be captured."""
    try:
        graph, _ = capture_graph(fn)
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

    with torch.no_grad():  # no autograd graph may outlive this line (its nodes would pin the stream)
        do = torch.randn_like(first(f(*inputs)))
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]

    def fwdbwd():
        torch.autograd.grad(first(f(*inputs)), leaves, do)

    return graph_ms(fwd, rep=rep), graph_ms(fwdbwd, rep=rep)


def call_times_ms(fn, n: int, device: torch.device, *, budget_s: float | None = None) -> list[float]:
    """Wall time of each of ``n`` calls of ``fn()`` in ms, the device synchronised before and after
    every call, so a time holds all the work the call queued (host overhead included: what an
    eager training or decoding loop sees).  With ``budget_s`` it stops early once the calls so far
    took that long (at least one call is always timed)."""
    cuda = device.type == "cuda"
    times: list[float] = []
    spent = 0.0
    for _ in range(n):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        spent += dt
        if budget_s is not None and spent >= budget_s:
            break
    return times


def quantiles(times_ms: list[float]) -> dict:
    """``{"median", "p10", "p90"}`` of a list of times (linear interpolation between order
    statistics; one time gives the same value three times)."""
    if not times_ms:
        raise ValueError("quantiles of an empty list")
    xs = sorted(times_ms)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": q(0.5), "p10": q(0.1), "p90": q(0.9)}


def git_commit() -> str | None:
    """The lintime checkout's commit (``+dirty`` when tracked files differ), ``None`` outside git.
    ``LINTIME_GIT_COMMIT`` overrides it: a copy of the working tree made elsewhere (e.g. on a remote GPU
    machine) can carry a stale ``.git``, so the caller passes the real one."""
    if os.environ.get("LINTIME_GIT_COMMIT"):
        return os.environ["LINTIME_GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False)
        if sha.returncode:
            return None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dist_version(name: str) -> str | None:
    """Installed version of a distribution (``None`` when absent), without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def matmul_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ b, warmup=20, rep=100) / 1e9


def copy_peak_gbps(n_bytes: int = 2 << 30) -> float:
    x = torch.randn(n_bytes // 4, device="cuda")
    y = torch.empty_like(x)
    return 2 * n_bytes / median_ms(lambda: y.copy_(x), warmup=10, rep=50) / 1e6


def environment(peaks: bool = True, device: torch.device | None = None) -> dict:
    """Versions, date, commit and the device; ``peaks`` adds the measured matmul / copy peaks
    (CUDA only).  ``device``: default the first CUDA device."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.device("cuda") if device is None else device
    env = {"torch": torch.__version__, "triton": triton_version,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "git_commit": git_commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1),
                   host=f"{_cpu_model()}, {os.cpu_count()} cores")  # eager timings are host-bound: record it
    else:
        env.update(device=f"cpu ({_cpu_model()}, {os.cpu_count()} cores, "
                          f"{torch.get_num_threads()} threads)")
        peaks = False
    # the anchors' libraries, from their metadata (importing them takes seconds)
    env["fla"] = dist_version("fla-core") or dist_version("flash-linear-attention")
    env["transformers"] = dist_version("transformers")
    if peaks:
        env["matmul_bf16_tflops"] = matmul_peak_tflops()
        env["copy_gbps"] = copy_peak_gbps()
    return env
