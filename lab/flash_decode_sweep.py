"""FLASH's fused decoding step (:func:`lintime.ops.mixed_chunk_decode_step_`, backend ``triton``) per launch variant
of its ``dec_*`` fields, at flash-base's shape (``S = 128``, ``E = 1536``, ``C = 256``, bf16, with the bias), for
several batch sizes, in one process.

    PYTHONPATH=. python3 lab/flash_decode_sweep.py [--batches 1,64,256] [--old PATH] [--out f.json]

Each sequence starts with a random fill of its chunk (uniform over ``0..C-1``) and one completed chunk, so the
steps see every fill and, over ``STEPS`` steps, chunk completions.  A variant's time: ``STEPS`` consecutive steps
captured in one CUDA graph (the state advances from step to step, as in decoding), replayed from a copy of the same
starting state; the median over ``--rounds`` rounds that time every variant in turn, per step, in microseconds.
``--old PATH``: another tree's ``decode.py`` (e.g. ``git show <commit>:lintime/ops/mixed_chunk/triton/decode.py``)
loaded as a module and timed as variant ``old`` with the launch it was tuned with.  Every variant's outputs and
final state are checked against the default's (bf16 outputs within 2 bf16 ulps of the largest value; the fp32
``kv`` within 1e-5 of its largest): a variant that fails exits non-zero after the JSON is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from ab import cloned, module_from_file, stateful_replays

from lintime.bench.measure import capture_graph

from lintime.ops import MixedChunkState
from lintime.ops.mixed_chunk.triton import decode as dec
from lintime.ops.mixed_chunk.triton.launch import default_launch

S, E, C = 128, 1536, 256
STEPS = 32
VARIANTS = {  # name: dec_* fields over the default launch
    "default": {},
    "bc64sw4": {"dec_bc": 64, "dec_warps_scores": 4},
    "bc64": {"dec_bc": 64},
    "bc256": {"dec_bc": 256},
    "sw4": {"dec_warps_scores": 4},
    "wide_w8": {"dec_warps_wide": 8},
    "wide_be32": {"dec_be_wide": 32},
    "be64w4": {"dec_be": 64, "dec_warps": 4, "dec_be_wide": 64, "dec_warps_wide": 4},
    "be16w2": {"dec_be": 16, "dec_warps": 2},
    "be32w2": {"dec_be": 32, "dec_warps": 2},
}
OLD_LAUNCH = {"dec_bc": 64, "dec_be": 32, "dec_warps": 4, "dec_be_wide": 64, "dec_warps_wide": 8}


def problem(N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dt, dev = torch.bfloat16, "cuda"
    fills = torch.randint(0, C, (N,), generator=g)
    keep = (torch.arange(C)[None, :] < fills[:, None])[:, :, None]
    state = MixedChunkState(
        kv=torch.randn(N, 1, S, E, generator=g).to(dev), count=torch.full((N,), C, dtype=torch.long, device=dev),
        k_quad=(torch.randn(N, C, S, generator=g) * keep)[:, :, None].to(dev, dt),
        k_lin=(torch.randn(N, C, S, generator=g) * keep * 0.5)[:, :, None].to(dev, dt),
        v=(torch.randn(N, C, E, generator=g) * keep)[:, :, None].to(dev, dt), fill=fills.to(dev))
    h = torch.randn(STEPS, N, 2 * E + S, generator=g).to(dev, dt)
    gamma, beta = (1 + 0.3 * torch.randn(4, S, generator=g)).to(dev, dt), (0.3 * torch.randn(4, S, generator=g)).to(dev, dt)
    pos = (C + fills)[None, :].to(dev) + torch.arange(STEPS, device=dev)[:, None]
    bias = (0.5 * torch.randn(2 * C - 1, generator=g)).to(dev, dt)
    return h, gamma, beta, pos, bias, state


def steps_fn(launcher, launch, h, gamma, beta, pos, bias, st):
    flat = [st.kv[:, 0], st.count, st.k_quad[:, :, 0], st.k_lin[:, :, 0], st.v[:, :, 0], st.fill]

    def run():
        return [launcher(h[t], gamma, beta, pos[t], *flat, bias, 1.0 / C, "tokens", 10000.0, launch=launch)
                for t in range(STEPS)]
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--old", default=None, help="another tree's decode.py, timed as variant 'old'")
    ap.add_argument("--old-fields", default=json.dumps(OLD_LAUNCH),
                    help="JSON: the dec_* fields the old decode.py runs with (default: fdb2dac's one-kernel step's; "
                         "'{}' for the default launch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    base = default_launch(S, E, torch.bfloat16, C)
    launchers = {v: (dec.triton_decode_step_, dataclasses.replace(base, **VARIANTS[v])) for v in a.variants.split(",")}
    if a.old:
        old = module_from_file(a.old, "old_decode")
        launchers["old"] = (old.triton_decode_step_, dataclasses.replace(base, **json.loads(a.old_fields)))
    rows, failed = [], []
    for N in (int(x) for x in a.batches.split(",")):
        h, gamma, beta, pos, bias, st0 = problem(N)
        graphs, results = {}, {}
        for name, (fn, launch) in launchers.items():
            st = cloned(st0)
            outs = steps_fn(fn, launch, h, gamma, beta, pos, bias, st)()  # compiles; the reference run
            torch.cuda.synchronize()
            results[name] = (torch.stack(outs).float(), st)
            work = cloned(st0)
            graph, _ = capture_graph(steps_fn(fn, launch, h, gamma, beta, pos, bias, work))
            graphs[name] = (graph, work)
        ref_out, ref_st = results["default"]
        for name, (out, st) in results.items():
            e_out = (out - ref_out).abs().max().item() / ref_out.abs().max().item()
            e_kv = (st.kv - ref_st.kv).abs().max().item() / ref_st.kv.abs().max().item()
            same = all(torch.equal(getattr(st, f), getattr(ref_st, f)) for f in ("fill", "count"))
            ok = e_out <= 2 * 2 ** -8 and e_kv <= 1e-5 and same
            if not ok:
                failed.append((N, name, e_out, e_kv, same))
            results[name] = {"out_rel_err": e_out, "kv_rel_err": e_kv, "counters_equal": same, "ok": ok}
        times = stateful_replays(graphs, st0, a.rounds, a.replays, STEPS)
        for name in graphs:
            us = times[name]
            rows.append({"N": N, "variant": name, "us_per_step": us, **results[name]})
            print(f"N={N:4d} {name:10s} {us:8.2f} us/step  out err {results[name]['out_rel_err']:.2e} "
                  f"kv err {results[name]['kv_rel_err']:.2e} {'ok' if results[name]['ok'] else 'MISMATCH'}", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"shape": {"S": S, "E": E, "C": C, "dtype": "bf16", "steps": STEPS}, "rows": rows,
                       "device": torch.cuda.get_device_name(0)}, fh, indent=1)
    for f in failed:
        print("MISMATCH", f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
