"""Launch A/B of the fused norm kernels (:class:`lintime.modules.norm.triton.launch.NormLaunch`): one row per iteration
against ``[BM, BD]`` tiles of several rows, one process, interleaved.

    PYTHONPATH=. python3 lab/norm_ab.py [--out $OUT/norm_ab.json] [--configs one-row,default,...] [--stream fp32]

Cases: ``normalize`` / ``add_normalize`` / ``gated_normalize``, layernorm (gain and bias) and rmsnorm, at
flash-base's rows ``[32768, 768]``, and gla-base's gated rmsnorm ``[131072, 192]``; bf16 rows, gate, branch and
result (``--stream fp32``: the autocast mix instead, an fp32 residual stream / normalised rows with bf16 branch,
gate and result).  Each case's forward (no grad) and forward + backward (every input's gradient; both outputs of
``add_normalize`` get one, as in a block) are captured in CUDA graphs per launch, so a time is the device's (the
host's launch cost is not in it), then replayed in ``--rounds`` rounds that time every launch in turn
(:func:`lintime.bench.measure.median_ms` of the replay); a row's time is the median over the rounds.  ``GB/s``
counts the bytes the kernels must move (every row tensor read or written once; statistics and the ``dw``
partials left out).  Each launch's outputs and gradients are checked against the default launch's: bf16
results within one bf16 ulp of the largest value, fp32 ones within 1e-5 of it (the reductions may sum in
another order); a launch that fails exits non-zero after the JSON is written.

``--smoke``: the code paths on the CPU (Triton's interpreter, tiny shapes, no graphs, no timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lintime.modules import add_normalize, gated_normalize, normalize  # noqa: E402
from lintime.modules.norm.triton import ops as norm_ops  # noqa: E402
from lintime.modules.norm.triton import launch as norm_launch  # noqa: E402
from lintime.modules.norm.triton.launch import NormLaunch  # noqa: E402

# The launches compared, in the order they are captured (a spent budget skips the last).  "one-row": one [BD] row
# per iteration, BD / 256 warps, 8 programs per SM (the kernels' launch before tiles); "one-row-fit": the same with
# the grid sized to what the SMs hold at once (no second wave); "default": NormLaunch(); the rest vary its tile and
# warps (ptxas, sm_90, offline: default bwd 99-128 registers -> 2 programs of 8 warps per SM; "warps4": 160-245
# registers -> 2-3 programs of 4 warps, more elements per register)
CONFIGS = {
    "one-row": NormLaunch(rows_per_tile=1, elems_per_warp=256, programs_per_sm=8),
    "default": NormLaunch(),
    "one-row-fit": NormLaunch(rows_per_tile=1, elems_per_warp=256),
    "warps4": NormLaunch(elems_per_warp=1024),
    "tile8192": NormLaunch(tile_elems=8192, elems_per_warp=1024),
    "tile2048": NormLaunch(tile_elems=2048),
}

# (name, op, kind, N, D)
CASES = [
    ("normalize layernorm", "normalize", "layernorm", 32768, 768),
    ("normalize rmsnorm", "normalize", "rmsnorm", 32768, 768),
    ("add_normalize layernorm", "add", "layernorm", 32768, 768),
    ("add_normalize rmsnorm", "add", "rmsnorm", 32768, 768),
    ("gated_normalize layernorm", "gated", "layernorm", 32768, 768),
    ("gated_normalize rmsnorm", "gated", "rmsnorm", 32768, 768),
    ("gated_normalize rmsnorm gla", "gated", "rmsnorm", 131072, 192),
]
SMOKE_SHAPES = {768: 48, 192: 24}  # D -> the smoke run's D (rows: N // 256 + 3)


class Case:
    """One op at one shape: its inputs, the forward and forward + backward as functions, the bytes they move."""

    def __init__(self, name, op, kind, N, D, stream, dev):
        self.name, self.op, self.kind, self.N, self.D = name, op, kind, N, D
        g = torch.Generator().manual_seed(0)
        bf = torch.bfloat16

        def rnd(dtype, scale=1.0, shift=0.0):
            return (torch.randn(N, D, generator=g) * scale + shift).to(dev, dtype)

        self.x = rnd(stream, 2.0, 0.3).requires_grad_()
        self.other = None if op == "normalize" else rnd(bf, 1.0 if op == "add" else 2.0).requires_grad_()
        self.w = (1.0 + 0.3 * torch.randn(D, generator=g)).to(dev).requires_grad_()
        self.b = (0.2 * torch.randn(D, generator=g)).to(dev).requires_grad_() if kind == "layernorm" else None
        n_out = 2 if op == "add" else 1
        s_dtype = torch.promote_types(stream, bf)
        self.grads = [rnd(s_dtype if (op == "add" and i == 0) else bf) for i in range(n_out)]
        self.leaves = [t for t in (self.x, self.other, self.w, self.b) if t is not None]
        # bytes the kernels must move: every [N, D] row tensor read or written once
        es = {torch.float32: 4, torch.bfloat16: 2}
        row = N * D
        xs, bs, ss = es[stream], es[bf], es[s_dtype]
        if op == "normalize":
            self.fwd_bytes = row * (xs + bs)  # x -> y
            bwd = row * (xs + bs + xs)  # x, dy -> dx
        elif op == "add":
            self.fwd_bytes = row * (xs + bs + ss + bs)  # x, r -> s, y
            bwd = row * (ss + bs + ss + xs + (bs if bs != xs else 0))  # s, dy, ds -> dx (, dr)
        else:
            self.fwd_bytes = row * (xs + bs + bs)  # x, z -> y
            bwd = row * (xs + bs + bs + xs + bs)  # x, z, dy -> dx, dz
        self.fwdbwd_bytes = self.fwd_bytes + bwd

    def call(self, x, other, w, b):
        kw = dict(kind=self.kind, out_dtype=torch.bfloat16, backend="triton")
        if self.op == "normalize":
            return (normalize(x, w, b, **kw),)
        if self.op == "add":
            return add_normalize(x, other, w, b, **kw)
        return (gated_normalize(x, other, w, b, **kw),)

    def fwd(self):
        with torch.no_grad():
            return self.call(self.x, self.other, self.w, self.b)

    def fwdbwd(self):
        outs = self.call(self.x, self.other, self.w, self.b)
        return (*(o.detach() for o in outs), *torch.autograd.grad(outs, self.leaves, self.grads))


def max_diff(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """``max |a - ref| / max |ref|`` and whether it is within the dtype's bound (see the module docstring)."""
    a, ref = a.detach().double(), ref.detach().double()
    scale = ref.abs().max().clamp_min(1e-30)
    rel = float((a - ref).abs().max() / scale)
    return rel, rel <= (2.0**-7 if a.dtype == torch.bfloat16 or ref.dtype == torch.bfloat16 else 1e-5)


def check(outs, ref_outs) -> dict:
    rels, oks, equal = [], [], True
    for a, r in zip(outs, ref_outs):
        rel, ok = max_diff(a, r)
        rels.append(rel)
        oks.append(ok)
        equal = equal and torch.equal(a, r)
    return dict(max_rel=max(rels), ok=all(oks), bitwise=equal)


def with_launch(cfg: NormLaunch, fn, grids: list | None = None):
    """``fn()`` with the norm ops launched under ``cfg`` (graphs captured there keep it); ``grids`` gets
    ``[BM, num_warps, programs]`` of every launch (``x`` ``tiles``: as :func:`norm_ops._programs` takes them)."""
    saved, programs = norm_launch.LAUNCH, norm_ops._programs

    def recorded(kernel, args, meta, x, tiles):
        G = programs(kernel, args, meta, x, tiles)
        if grids is not None:
            grids.append([meta["BM"], meta["num_warps"], G])
        return G

    norm_launch.LAUNCH, norm_ops._programs = cfg, recorded
    try:
        return fn()
    finally:
        norm_launch.LAUNCH, norm_ops._programs = saved, programs


def smoke(names: list[str]) -> int:
    """The cases at tiny shapes on the CPU, every launch checked against the default's (no timing)."""
    bad = 0
    for name, op, kind, N, D in CASES:
        case = Case(name, op, kind, N // 256 + 3, SMOKE_SHAPES[D], torch.float32, "cpu")
        ref = with_launch(CONFIGS["default"], case.fwdbwd)
        for cfg_name in names:
            launches: list = []
            res = check(with_launch(CONFIGS[cfg_name], case.fwdbwd, launches), ref)
            bad += not res["ok"]
            print(f"{name:28s} {cfg_name:11s} {launches} {res}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm_ab.json"))
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"launches to compare, of {list(CONFIGS)}")
    ap.add_argument("--cases", default="", help="substring filter on the case names (default: all)")
    ap.add_argument("--stream", default="bf16", choices=["bf16", "fp32"], help="dtype of x (the rows normalised)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=40, help="ms of replays per timing (triton.testing.do_bench)")
    ap.add_argument("--budget", type=float, default=75.0, help="s: no further launch is captured, and no further "
                    "round started, past it")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, checks only")
    args = ap.parse_args()
    asked = [c for c in args.configs.split(",") if c]
    if set(asked) - set(CONFIGS):
        ap.error(f"unknown --configs {sorted(set(asked) - set(CONFIGS))}; known: {list(CONFIGS)}")
    names = [c for c in CONFIGS if c in asked]
    if "default" not in names:  # the reference of every check
        names.insert(0, "default")
    if args.smoke:
        sys.exit(1 if smoke(names) else 0)

    from lintime.bench.measure import capture_graph, git_commit, median_ms

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    stream = torch.float32 if args.stream == "fp32" else torch.bfloat16
    cases = [Case(*c, stream, dev) for c in CASES if args.cases in c[0]]
    # capture: per launch, per case, the two graphs (the Triton compiles happen here)
    graphs: dict[tuple[str, str, str], torch.cuda.CUDAGraph] = {}
    outputs: dict[tuple[str, str, str], tuple] = {}
    grids: dict[tuple[str, str], list] = {}  # (config, case) -> [BM, warps, programs] of the fwd and the bwd launch
    captured = []
    for cfg_name in names:
        if cfg_name not in ("one-row", "default") and time.perf_counter() - t0 > 0.6 * args.budget:
            print(f"budget: {cfg_name} skipped", flush=True)
            continue
        for case in cases:
            launches: list = []
            with_launch(CONFIGS[cfg_name], case.fwdbwd, launches)  # compiles; records the grids
            grids[cfg_name, case.name] = launches
            for mode in ("fwd", "fwdbwd"):
                g, out = with_launch(CONFIGS[cfg_name], lambda: capture_graph(getattr(case, mode)))
                graphs[cfg_name, case.name, mode], outputs[cfg_name, case.name, mode] = g, out
        captured.append(cfg_name)
        print(f"captured {cfg_name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    torch.cuda.synchronize()
    # interleaved rounds: every launch of a case timed in turn
    times: dict[tuple[str, str, str], list[float]] = {k: [] for k in graphs}
    for i in range(args.rounds):
        if i and time.perf_counter() - t0 > args.budget:
            print(f"budget: {i} of {args.rounds} rounds", flush=True)
            break
        for case in cases:
            for mode in ("fwd", "fwdbwd"):
                for cfg_name in captured:
                    times[cfg_name, case.name, mode].append(
                        median_ms(graphs[cfg_name, case.name, mode].replay, warmup=5, rep=args.rep))
    rows, failed = [], []
    for case in cases:
        for cfg_name in captured:
            row = dict(case=case.name, shape=[case.N, case.D], stream=args.stream, config=cfg_name,
                       fwd_bwd_grids=grids[cfg_name, case.name])
            for mode in ("fwd", "fwdbwd"):
                key = (cfg_name, case.name, mode)
                graphs[key].replay()
                torch.cuda.synchronize()
                ms = statistics.median(times[key])
                nbytes = case.fwd_bytes if mode == "fwd" else case.fwdbwd_bytes
                row[f"{mode}_ms"] = round(ms, 4)
                row[f"{mode}_gbs"] = round(nbytes / ms / 1e6, 1)
                row[f"{mode}_all_ms"] = [round(t, 4) for t in times[key]]
                row[f"{mode}_check"] = check(outputs[key], outputs["default", case.name, mode])
                if not row[f"{mode}_check"]["ok"]:
                    failed.append(f"{case.name} {cfg_name} {mode}")
            base = next((r for r in rows if r["case"] == case.name and r["config"] == "one-row"), None)
            if base is not None:
                row["fwd_x"] = round(base["fwd_ms"] / row["fwd_ms"], 3)
                row["fwdbwd_x"] = round(base["fwdbwd_ms"] / row["fwdbwd_ms"], 3)
            rows.append(row)
    print(f"{'case':28s} {'launch':11s} {'fwd ms':>8s} {'GB/s':>6s} {'x':>6s} {'fwd+bwd':>8s} {'GB/s':>6s} {'x':>6s}  "
          f"{'BM/warps/G fwd bwd':21s} check (max rel vs default)")
    for r in rows:
        chk = "bitwise" if r["fwd_check"]["bitwise"] and r["fwdbwd_check"]["bitwise"] else (
            f"{max(r['fwd_check']['max_rel'], r['fwdbwd_check']['max_rel']):.1e}"
            + ("" if r["fwd_check"]["ok"] and r["fwdbwd_check"]["ok"] else " FAIL"))
        grid = " ".join("/".join(map(str, g)) for g in r["fwd_bwd_grids"])
        print(f"{r['case']:28s} {r['config']:11s} {r['fwd_ms']:8.4f} {r['fwd_gbs']:6.0f} {r.get('fwd_x', 1.0):6.2f} "
              f"{r['fwdbwd_ms']:8.4f} {r['fwdbwd_gbs']:6.0f} {r.get('fwdbwd_x', 1.0):6.2f}  {grid:21s} {chk}")
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=git_commit(),
               sms=torch.cuda.get_device_properties(0).multi_processor_count, seconds=round(time.perf_counter() - t0))
    configs = {n: dataclasses.asdict(CONFIGS[n]) for n in captured}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, configs=configs, rows=rows, failed=failed), f, indent=1)
    print(f"{env}\nwrote {args.out}")
    if failed:
        print("FAILED checks:", failed)
        sys.exit(1)


if __name__ == "__main__":
    main()
