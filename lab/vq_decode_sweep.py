"""Transformer-VQ's fused decoding step (:func:`lintime.ops.vq.triton.decode.triton_decode_step_`) per variant of
:class:`~lintime.ops.vq.triton.launch.VQLaunch`'s decoding fields (``dec_*``: the scores kernel's key block and
warps, the values kernel's slot / code / value tiles, score row chunk and warps, key splits), at vq-base's shape
(``K = 128``, ``V = 1536``, ``S = 512`` codes, ``L = 512``, one head, bf16, the relative bias), for several batch
sizes, in one process.

    PYTHONPATH=. python3 lab/vq_decode_sweep.py [--batches 1,64] [--variants default,...] [--old PATH] [--out f.json]
    PYTHONPATH=. python3 lab/vq_decode_sweep.py --smoke [--old PATH]   # the code path on a CPU: no timing

Each sequence starts past its first two blocks (position ``2L + r``, ``r`` random per sequence: a full previous block
in the window and a cache), so a step reads what a long decode reads; ``STEPS`` consecutive steps (a block end among
them for some sequences) are captured in one CUDA graph and replayed from a copy of the same starting state; the
median over ``--rounds`` rounds that time every variant in turn, per step, in microseconds.  A variant is the default
launch with some fields replaced.  ``--old PATH``: another tree's ``decode.py`` (e.g. ``git show
<commit>:lintime/ops/vq/triton/decode.py``) loaded as a module and timed as variant ``old`` with the launch it was
tuned with (``OLD_LAUNCH`` over the default; it takes its launch from ``default_launch``, patched in that module).
Every variant's outputs and final state are checked against the default's (bf16 outputs within 2 bf16 ulps of the
largest value; the fp32 cache within 1e-5 of its largest; positions, codes, counts and the window equal); a variant
that fails exits non-zero after the JSON is written.  ``--smoke``: the interpreter, a tiny shape, batches 1 and 4
unless ``--batches`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ab import cloned, module_from_file, stateful_replays  # noqa: E402

from lintime.bench.measure import capture_graph  # noqa: E402
from lintime.ops.vq.state import VQState  # noqa: E402
from lintime.ops.vq.triton import decode as dec  # noqa: E402
from lintime.ops.vq.triton.launch import default_launch  # noqa: E402

K, V, S, L, H = 128, 1536, 512, 512, 1
STEPS = 16
VARIANTS = {  # name: dec_* fields over the default launch
    "default": {},
    "bt16": {"dec_bt": 16},  # scores kernel: more, smaller key blocks
    "bt64": {"dec_bt": 64},
    "bt64sw8": {"dec_bt": 64, "dec_warps_scores": 8},
    "bn64": {"dec_bn": 64},  # values kernel: longer window steps (fewer dependent loads, more registers)
    "bn64bs64w8": {"dec_bn": 64, "dec_bs": 64, "dec_warps_values": 8},
    "bs16": {"dec_bs": 16},  # the fp32 means in tiles of a window tile's bytes
    "bv64": {"dec_bv": 64},  # twice the value programs
    "bv256w8": {"dec_bv": 256, "dec_warps_values": 8},
    "vw8": {"dec_warps_values": 8},
    "vw2": {"dec_warps_values": 2},
    "br1024": {"dec_br": 1024},  # the score row's max / sum in two chunks
    "split8": {"dec_split_per_sm": 8},  # batch 1: more key splits
    "split16": {"dec_split_per_sm": 16},
    "tiles1": {"dec_split_tiles": 1},
}
# the launch the previous kernel (one attention kernel per value tile) was tuned with
OLD_LAUNCH = {"dec_bn": 32, "dec_bs": 32, "dec_bv": 128, "dec_split_per_sm": 4, "dec_split_tiles": 2}


def problem(N: int, dev: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    r = torch.randint(0, L, (N,), generator=g)
    filled = (torch.arange(2 * L)[None, :] < (L + r)[:, None])  # previous block + the current one's first r slots
    cb = torch.randn(H, S, K, generator=g) * 0.5
    codes = torch.randint(0, S, (N, 2 * L, H), generator=g) * filled[:, :, None]
    k_hat = cb[0][codes[:, :, 0]][:, :, None] * filled[:, :, None, None]
    state = VQState(
        cache_mean=torch.randn(N, H, S, V, generator=g).to(dev),
        cache_count=torch.randint(1, 8, (N, H, S), generator=g).float().to(dev),
        k_hat=k_hat.to(dev, dt).contiguous(),
        v=(torch.randn(N, 2 * L, H, V, generator=g) * filled[:, :, None, None]).to(dev, dt),
        codes=codes.to(dev), pos=(2 * L + r).to(dev))
    q = torch.randn(STEPS, N, H, K, generator=g).to(dev, dt)
    zn = torch.randint(0, S, (STEPS, N, H), generator=g)
    kn = cb[0][zn[..., 0]][:, :, None].to(dev, dt)
    vn = torch.randn(STEPS, N, H, V, generator=g).to(dev, dt)
    qv = torch.randn(STEPS, N, H, K, generator=g).to(dev, dt)
    rt = (0.3 * torch.randn(L + 1, H, K, generator=g)).to(dev, dt)
    return (q, kn, zn.to(dev), vn, qv), cb.to(dev, dt), rt, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=None, help="default 1,64 (--smoke: 1,4)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--old", default=None, help="another tree's decode.py, timed as variant 'old'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape: checks only")
    a = ap.parse_args(argv)
    if a.smoke:
        global K, V, S, L, STEPS
        K, V, S, L, STEPS = 16, 48, 16, 8, 10
    dev = "cpu" if a.smoke else "cuda"
    batches = a.batches or ("1,4" if a.smoke else "1,64")
    base = default_launch(K, V, torch.bfloat16)
    names = a.variants.split(",")
    if "default" not in names:
        names.insert(0, "default")  # the reference of every check
    launchers = {v: (dec.triton_decode_step_, dataclasses.replace(base, **VARIANTS[v])) for v in names}
    old = None
    if a.old:
        old = module_from_file(a.old, "old_vq_decode")
        launchers["old"] = (old.triton_decode_step_, dataclasses.replace(base, **OLD_LAUNCH))
    rows, failed = [], []

    def run_steps(name, st, q, kn, zn, vn, qv, cb, rt):
        fn, cfg = launchers[name]
        kw = {} if name == "old" else {"launch": cfg}
        return [fn(q[t], kn[t], zn[t], vn[t], cb, st, rel_bias=(qv[t], rt), **kw) for t in range(STEPS)]

    for N in (int(x) for x in batches.split(",")):
        (q, kn, zn, vn, qv), cb, rt, st0 = problem(N, dev)
        graphs, results = {}, {}
        for name, (_, cfg) in launchers.items():
            if name == "old":  # the old module reads default_launch from its own namespace
                old.default_launch = lambda *args, cfg=cfg, **kw: cfg
            st = cloned(st0)
            results[name] = (torch.stack(run_steps(name, st, q, kn, zn, vn, qv, cb, rt)).float(), st)  # compiles
            if a.smoke:
                continue
            work = cloned(st0)
            graph, _ = capture_graph(lambda name=name, work=work: run_steps(name, work, q, kn, zn, vn, qv, cb, rt))
            graphs[name] = (graph, work)
        ref_out, ref_st = results["default"]
        for name, (out, st) in results.items():
            e_out = (out - ref_out).abs().max().item() / ref_out.abs().max().item()
            e_m = (st.cache_mean - ref_st.cache_mean).abs().max().item() / ref_st.cache_mean.abs().max().item()
            same = all(torch.equal(getattr(st, f), getattr(ref_st, f))
                       for f in ("pos", "codes", "cache_count", "k_hat", "v"))
            ok = e_out <= 2 * 2 ** -8 and e_m <= 1e-5 and same
            if not ok:
                failed.append((N, name, e_out, e_m, same))
            results[name] = {"out_rel_err": e_out, "cache_rel_err": e_m, "counters_equal": same, "ok": ok}
        for name in results if a.smoke else ():
            rows.append({"N": N, "variant": name, **results[name]})
            print(f"N={N:4d} {name:12s} out err {results[name]['out_rel_err']:.2e} "
                  f"{'ok' if results[name]['ok'] else 'MISMATCH'}", flush=True)
        times = {} if a.smoke else stateful_replays(graphs, st0, a.rounds, a.replays, STEPS)
        for name in graphs:
            us = times[name]
            rows.append({"N": N, "variant": name, "us_per_step": us, **results[name]})
            print(f"N={N:4d} {name:12s} {us:9.2f} us/step  out err {results[name]['out_rel_err']:.2e} "
                  f"cache err {results[name]['cache_rel_err']:.2e} {'ok' if results[name]['ok'] else 'MISMATCH'}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"shape": {"K": K, "V": V, "S": S, "L": L, "H": H, "dtype": "bf16", "steps": STEPS},
                       "variants": {n: VARIANTS[n] for n in names}, "old": a.old, "old_launch": OLD_LAUNCH,
                       "rows": rows,
                       "device": "cpu (interpreter)" if a.smoke else torch.cuda.get_device_name(0)}, fh, indent=1)
    for f in failed:
        print("MISMATCH", f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
