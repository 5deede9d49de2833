"""Where a long prefill spends its time: the previous prefill (fixed pieces through ``model(...)``: every
token's logits, a fresh state whose values the ops check on the host) against
:func:`lintime.generation.prefill` (automatic pieces: the whole prompt per model call up to
``PREFILL_TOKENS``, only the last token's logits), on one GPU, bf16 autocast over fp32 weights (as
``lintime bench model``), batch 1, random weights and tokens.

Per variant: wall ms of the prefill (median of ``--repeats`` after a warm-up), tokens/s, model calls,
host->device syncs and PyTorch calls (:func:`lintime.generation.profiling.count_host_syncs`), then one
run under ``torch.profiler``: the busy time of the GPU (the union of its kernels' intervals) against
the wall time (what is left is the device waiting for the host) and the top operators by host and by
device time.

    PYTHONPATH=. python3 lab/prefill_profile.py [--preset flash-base] [--L 32768] [--old-chunk 8192] [--rows 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lintime.generation import prefill
from lintime.generation.decode import PREFILL_TOKENS
from lintime.generation.profiling import count_host_syncs
from lintime.models import CausalLM, get_preset


def old_prefill(model, ids, C):
    """The prefill before whole-prompt pieces: ``model(piece, state, return_state=True)`` per piece of ``C``
    tokens (``[B, C, V]`` logits each; the fresh state's values checked by the ops on the first call)."""
    B, T = ids.shape
    state = model.init_state(B, device=ids.device)
    for start in range(0, T, C):
        out, state = model(ids[:, start : start + C], state, return_state=True)
        logits = out[:, -1]
    return logits, state


def busy_ms(prof) -> float:
    """The union of the device kernels' intervals (ms): time the GPU computed."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3  # us -> ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-base")
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--old-chunk", type=int, default=8192, help="pieces of the previous prefill")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=12, help="operators listed per table")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of this script, tiny presets)")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = CausalLM(get_preset(args.preset)).to(dev).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.L), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    variants = {
        f"before: {args.old_chunk}-token pieces via model()": lambda: old_prefill(model, ids, args.old_chunk),
        f"after: prefill() automatic (PREFILL_TOKENS={PREFILL_TOKENS})": lambda: prefill(model, ids),
    }
    ctx = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")  # noqa: E731
    ref = None
    for name, fn in variants.items():
        with torch.no_grad(), ctx():
            fn()  # warm-up: Triton compilation
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                logits, _ = fn()
                sync()
                times.append(1e3 * (time.perf_counter() - t0))
            with count_host_syncs() as c:
                fn()
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if dev.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                t0 = time.perf_counter()
                fn()
                sync()
                wall = 1e3 * (time.perf_counter() - t0)
        ms = statistics.median(times)
        print(f"\n=== {args.preset} L={args.L} {name}")
        print(f"wall {ms:.1f} ms (median of {args.repeats}) = {args.L / ms * 1e3:,.0f} tokens/s; syncs {c.total} "
              f"{dict(c.counts)}, host-built tensors {c.h2d}, PyTorch calls {c.ops}")
        busy = busy_ms(prof)
        print(f"profiled run: wall {wall:.1f} ms, GPU busy {busy:.1f} ms ({100 * busy / wall:.0f} %), "
              f"GPU idle (waiting for the host) {wall - busy:.1f} ms")
        ka = prof.key_averages()
        print(ka.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        print(ka.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60))
        if ref is None:
            ref = logits.float()
        else:
            err = (logits.float() - ref).abs().max().item() / ref.abs().max().item()
            print(f"last logits vs before: max relative difference {err:.2e}")


if __name__ == "__main__":
    main()
