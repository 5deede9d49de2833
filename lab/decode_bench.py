"""Decoding speed per preset and context: ms per generated token, eager vs CUDA graph, and prefill
tokens/s (one GPU, batch 1 by default, bf16, random weights and prompts).

For every preset and prompt length ``L``: prefill ``L`` random tokens in pieces of each size of
``--prefill-chunks`` (timed: tokens/s; 0 = ``prefill``'s automatic pieces, the default of
``GenerationConfig.prefill_chunk``), then from the
last state

* ``eager``   ``decode_one_token`` per token (a new state object per step, greedy);
* ``static``  the in-place state buffers (``StaticDecoder``) stepped eagerly;
* ``graph``   the same step captured once in a CUDA graph and replayed (``DecodeLoop``);

each timed over ``--tokens`` steps after ``--warmup`` steps (median of ``--repeats``), with the
first greedy tokens of ``eager`` and ``graph`` compared (``graph_same_tokens``).  ``--flash-recurrent-step`` adds
``graph_recurrent_step``: the graph path with FLASH's step in the op's recurrent form instead of the fused decode
kernels (``lintime.ops.mixed_chunk_decode_step_``).  One JSON line per
(preset, L) on stdout; ``--json`` also writes them to a file.

    python3 lab/decode_bench.py [--presets flash-base,gla-base,transformer-pp-base] [--lengths 1024,8192,32768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lintime.generation import decode_one_token, prefill
from lintime.generation.graphs import build_loop
from lintime.generation.static import StaticDecoder
from lintime.layers.flash import FLASH
from lintime.models import CausalLM, get_preset


def _timed(fn, sync=True) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench(preset: str, L: int, args) -> dict:
    torch.manual_seed(0)
    cfg = get_preset(preset, vocab_size=args.vocab)
    m = CausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    B, n = args.batch, args.tokens
    ids = torch.randint(0, args.vocab, (B, L), device="cuda")
    row = {"preset": preset, "L": L, "batch": B, "device": torch.cuda.get_device_name()}
    with torch.no_grad():
        out = {}
        for C in (int(c) for c in args.prefill_chunks.split(",")):
            prefill(m, ids[:, : min(L, C or L)], chunk_size=C)  # compile / warm the kernels
            t = _timed(lambda: out.update(zip(("logits", "state"), prefill(m, ids, chunk_size=C))))
            row[f"prefill_tok_s@{C}"] = B * L / t
        logits, state = out["logits"], out["state"]
        first = logits.argmax(-1)
        steps = args.warmup + n

        # eager: a new state per step
        def eager_run(k, st=state, tok=first):
            toks = []  # the tokens fed, as DecodeLoop.tokens records them
            for _ in range(k):
                toks.append(tok)
                lg, st = decode_one_token(m, tok, st)
                tok = lg.argmax(-1)
            return toks

        eager_tokens = torch.stack(eager_run(min(steps, 16)), 1).tolist()
        eager_run(args.warmup)
        row["eager_ms"] = 1e3 * statistics.median(_timed(lambda: eager_run(n)) / n for _ in range(args.repeats))

        capacity = L + args.repeats * steps + steps
        flash = [blk.mixer for blk in m.backbone.blocks if isinstance(blk.mixer, FLASH)]
        paths = [("static", False, None), ("graph", True, None)]
        if args.flash_recurrent_step and flash:  # FLASH's step before the fused kernels, for the comparison
            paths.append(("graph_recurrent_step", True, "recurrent"))
        for name, graph, backend in paths:
            for mixer in flash:
                mixer.backend = backend
            dec = StaticDecoder(m, state, capacity)
            loop = build_loop(dec, logits, torch.zeros(B, dtype=torch.long, device="cuda"),
                              args.repeats * steps + steps, graph=graph, temperature=0.0)
            if graph:
                row[f"{name}_captured"] = loop.graph is not None
            for _ in range(min(steps, 16)):
                loop.advance()
            if graph:
                row[f"{name}_same_tokens"] = loop.tokens[:, : min(steps, 16)].tolist() == eager_tokens
            times = []
            for _ in range(args.repeats):
                for _ in range(args.warmup):
                    loop.advance()
                times.append(_timed(lambda: [loop.advance() for _ in range(n)]) / n)
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
            del loop, dec
        for mixer in flash:
            mixer.backend = None
        row["state_mib"] = sum(t.numel() * t.element_size() for t in StaticDecoder(m, state, L + 1).buffers()) / 2**20
    del m, state, out
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="flash-base,gla-base,transformer-pp-base")
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prefill-chunks", default="8192,0", help="prefill piece sizes to time, 0 = automatic (the last one's state decodes)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flash-recurrent-step", action="store_true",
                    help="also time the graph path with FLASH's one-token step in its recurrent form (the path "
                         "before the fused decode kernels): the graph_recurrent_step_* columns")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        for L in (int(x) for x in args.lengths.split(",")):
            row = bench(preset, L, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
