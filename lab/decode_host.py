"""Host (CPU) cost of one decoded token, per model family: device->host syncs and microseconds.

Counts, per call of :func:`lintime.generation.decode_one_token` after a short prefill, the calls
that would force a device->host synchronisation on CUDA (``Tensor.item``, ``Tensor.tolist``,
``Tensor.__bool__`` / ``__int__`` / ``__float__`` / ``__index__``, ``Tensor.cpu``, ``torch.tensor``
/ ``as_tensor`` built from host data) and times the call on the CPU (median of repeats of the
mean over ``--iters`` tokens).  These are CPU host-time measurements of the eager PyTorch path
(reference ops on CPU tensors), not GPU timings.

    python3 lab/decode_host.py [--presets flash-small,gla-small] [--iters 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lintime.generation import decode_one_token, prefill
from lintime.generation.profiling import count_host_syncs
from lintime.models import CausalLM, get_preset

DEFAULT = [
    "transformer-pp-tiny", "flash-tiny", "flash-quad-tiny", "mc-tfm-pp-tiny", "gla-tiny", "linear-tiny",
    "performer-tiny", "combiner-tiny", "vq-tiny",
    "transformer-pp-small", "flash-small", "mc-tfm-pp-small", "gla-small", "linear-small", "performer-small",
    "combiner-small", "vq-small",
]


def measure(name: str, iters: int, repeats: int, prompt: int = 12) -> dict:
    torch.manual_seed(0)
    m = CausalLM(get_preset(name)).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, prompt))
    with torch.no_grad():
        logits, state = prefill(m, ids)
        tok = logits.argmax(-1)
        logits, state = decode_one_token(m, tok, state)  # warm-up
        with count_host_syncs() as counter:
            decode_one_token(m, tok, state)
        times = []
        for _ in range(repeats):
            st = state
            t0 = time.perf_counter()
            for _ in range(iters):
                _, st = decode_one_token(m, tok, st)
            times.append((time.perf_counter() - t0) / iters)
    return {"preset": name, "layers": m.config.n_layers, "syncs": counter.total, "h2d": counter.h2d,
            "ops": counter.ops, "by_kind": dict(counter.counts), "us_per_token": statistics.median(times) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(DEFAULT))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(p, a.iters, a.repeats) for p in a.presets.split(",")]
    print(f"{'preset':24s} {'layers':>6s} {'syncs':>6s} {'h2d':>5s} {'ops':>6s} {'us/token':>9s}  syncs by kind")
    for r in rows:
        print(f"{r['preset']:24s} {r['layers']:6d} {r['syncs']:6d} {r['h2d']:5d} {r['ops']:6d} "
              f"{r['us_per_token']:9.0f}  {r['by_kind']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
