"""The interleaved A/B loop the lab's two-mode scripts share (``gla_gate_ab.py``, ``residual_ab.py``): both modes
warmed up, then ``rounds`` rounds that time each mode in turn (so a drifting clock or a neighbour's load falls on
both), medians, peak memory, and the one result line.  Timing: :func:`lintime.bench.measure.call_times_ms` (the
device synchronised around every call)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from lintime.bench.measure import call_times_ms

CUDA = torch.device("cuda")


def interleaved(modes: list[str], select: Callable[[str], None], step_of: Callable[[str], Callable], tokens: int,
                rounds: int, warmup: int = 3, per_round: int = 5) -> dict:
    """``{mode: {"ms", "tok_s", "peak_gib", "all_ms"}}``: ``select(mode)`` puts the model(s) in ``mode``,
    ``step_of(mode)`` is the step timed there."""
    ms: dict[str, list[float]] = {m: [] for m in modes}
    peak: dict[str, float] = {}
    for mode in modes:  # warm-up: Triton compiles, graph captures
        select(mode)
        call_times_ms(step_of(mode), warmup, CUDA)
    for _ in range(rounds):
        for mode in modes:
            select(mode)
            torch.cuda.reset_peak_memory_stats()
            ms[mode] += call_times_ms(step_of(mode), per_round, CUDA)
            peak[mode] = max(peak.get(mode, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    out = {}
    for mode in modes:
        med = statistics.median(ms[mode])
        out[mode] = {"ms": med, "tok_s": tokens / med * 1e3, "peak_gib": peak[mode], "all_ms": ms[mode]}
    return out


def line(label: str, row: dict) -> str:
    """``label  plain <ms> (<tok/s>, <GiB>)  fused <ms> (...)  x<speedup>  loss <plain> / <fused>``."""
    p, f = row["plain"], row["fused"]
    return (f"{label}  plain {p['ms']:7.1f} ms ({p['tok_s'] / 1e3:5.0f}k tok/s, {p['peak_gib']:.1f} GiB)  "
            f"fused {f['ms']:7.1f} ms ({f['tok_s'] / 1e3:5.0f}k tok/s, {f['peak_gib']:.1f} GiB)  "
            f"x{row['speedup']:.3f}  loss {row['loss_plain']:.6f} / {row['loss_fused']:.6f}")
