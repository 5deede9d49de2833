"""The serving engine alone, in process (no HTTP, no client threads): ``--requests`` greedy completions of a
``--prompt-tokens`` prompt submitted at once, ``--new-tokens`` each, with the decoding step replayed from CUDA graphs
and eagerly, two rounds each.  Reported: wall time, output tokens/s, time to first token (p50 / max) and the gaps
between a request's tokens (p50 / p99), from the engine's own event times.  Set against ``serve_bench.py`` (the
same load through ``lintime serve`` and the ``openai`` client), it splits the engine's cost from the HTTP layer's;
``engine_host_bench.py`` splits the loop thread's host work per decoding iteration from the step's, on the CPU.

    python3 benchmarks/engine_bench.py runs/flash-base --out $OUT

Results: ``$OUT/engine_bench.json`` and one JSON line per round on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from lintime.cli.loading import load_checkpoint
from lintime.serving import Engine, Request


def one_round(eng: Engine, prompt: str, requests: int, new_tokens: int) -> dict:
    t0 = time.perf_counter()
    handles = [eng.submit(Request(prompt, max_tokens=new_tokens, temperature=0)) for _ in range(requests)]
    events = [list(h.iter(timeout=600)) for h in handles]
    wall = time.perf_counter() - t0
    ttft = sorted(e[0].time - t0 for e in events)
    gaps = sorted(b.time - a.time for e in events for a, b in zip(e, e[1:])) or [0.0]
    tokens = sum(len(ev.token_ids) for e in events for ev in e)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "ttft_ms": {"p50": round(1e3 * ttft[len(ttft) // 2], 1), "max": round(1e3 * ttft[-1], 1)},
            "gap_ms": {"p50": round(1e3 * gaps[len(gaps) // 2], 2), "p99": round(1e3 * gaps[int(.99 * len(gaps))], 2)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="run, step or exported folder")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--modes", default="graph,eager", help="comma-separated: graph, eager")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 45 + 1))[: args.prompt_tokens - 1]
    rows = []
    for mode in args.modes.split(","):
        loaded = load_checkpoint(args.model, device=device)
        eng = Engine(loaded.model, loaded.tokenizer, max_batch=args.max_batch, graphs=mode == "graph").start()
        try:
            list(eng.submit(Request(prompt[:64], max_tokens=8, temperature=0)).iter(timeout=600))  # kernels warm
            for rnd in range(2):
                row = {"model": args.model, "mode": mode, "round": rnd, "capture_s": eng.capture_s,
                       **one_round(eng, prompt, args.requests, args.new_tokens), "engine": eng.stats()}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            eng.shutdown(timeout=60)
        del eng, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine_bench.json").write_text(json.dumps(
        {"commit": os.environ.get("LINTIME_GIT_COMMIT", ""), "device": str(device), "settings": vars(args),
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
