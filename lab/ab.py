"""The interleaved A/B loops the lab's scripts share.  :func:`interleaved` (``gla_gate_ab.py``, ``residual_ab.py``):
both modes warmed up, then ``rounds`` rounds that time each mode in turn (so a drifting clock or a neighbour's load
falls on both), medians, peak memory, and the one result line; timing: :func:`lintime.bench.measure.call_times_ms`
(the device synchronised around every call).  :func:`stateful_replays` (``flash_decode_sweep.py``,
``vq_decode_sweep.py``): captured steps that update a state in place, each replay from the same starting state;
:func:`module_from_file`: their ``--old`` tree's ``decode.py``."""

from __future__ import annotations

import dataclasses
import importlib.util
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


def module_from_file(path: str, name: str):
    """The Python file ``path`` loaded as a module named ``name`` (another tree's copy of one of lintime's modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cloned(state):
    """A copy of the dataclass ``state`` with every tensor field cloned."""
    return type(state)(**{f.name: getattr(state, f.name).clone() for f in dataclasses.fields(state)})


def restore(state, start) -> None:
    """Every tensor field of the dataclass ``state`` overwritten by ``start``'s (same shapes)."""
    for f in dataclasses.fields(state):
        getattr(state, f.name).copy_(getattr(start, f.name))


def stateful_replays(graphs: dict[str, tuple], start, rounds: int, replays: int, steps: int) -> dict[str, float]:
    """``{name: median us per step}`` of ``graphs`` (``name: (graph, state)``: a CUDA graph of ``steps`` steps that
    update ``state`` in place), in ``rounds`` rounds that replay every graph ``replays`` times in turn, each replay
    from ``start``'s values (the copy not timed: CUDA events around the replay only); a round's median per graph,
    then the median over the rounds."""
    times: dict[str, list[float]] = {n: [] for n in graphs}
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, (graph, state) in graphs.items():
            per = []
            for _ in range(replays):
                restore(state, start)
                begin.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                per.append(begin.elapsed_time(end) * 1000 / steps)
            times[name].append(statistics.median(per))
    return {n: statistics.median(t) for n, t in times.items()}
