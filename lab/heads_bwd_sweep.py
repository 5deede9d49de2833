"""Launch sweep of the FLASH projection's backward pieces with the bias folded in, at flash-base's shape (32k tokens,
e = 1536, s = 128, nh = 4, bf16, split heads, no gating): the heads op's backward (``HeadsLaunch``: ``bth``-row
heads blocks, ``rb`` of them per heads program, ``tr`` row tiles of ``bt x be`` per tile program, warps) and the gate's backward with a bias
(``GLULaunch.rb``).  Device ms by graph replay (median); every variant's outputs compared with the default's
(``dh`` / ``du`` bit for bit, the fp32 sums by their largest relative difference: the fold order moves with ``rb``).

    PYTHONPATH=. python3 lab/heads_bwd_sweep.py [--out f.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

import lintime.modules.glu.triton.ops as glu_ops
from lintime.bench.measure import git_commit, graph_ms
from lintime.modules.heads.triton.heads import _bwd_impl, default_launch

HEADS = ["", "rb=8", "rb=4", "rb=2", "rb=1", "bth=16,rb=8", "bth=16,rb=4", "bth=16,rb=2", "bth=16,rb=1",
         "bth=32,rb=2", "bth=32,rb=1", "rb=4,tr=32", "tr=32"]
GATE = [16, 8, 32]


def _cfg(base, spec: str):
    kw = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=")
        kw[k] = int(v)
    return replace(base, **kw)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="heads_bwd_sweep.json")
    a = ap.parse_args()
    dev, dt, TT, e, s, nh = torch.device("cuda"), torch.bfloat16, 32768, 1536, 128, 4
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    h, dv, dqs = 2 * rnd(1, TT, e + s), rnd(1, TT, e), [rnd(1, TT, 1, s) for _ in range(nh)]
    gamma, bias = torch.randn(nh, s, generator=g, device=dev), torch.randn(e + s, generator=g, device=dev)
    pos = torch.arange(TT, device=dev)[None]
    rows = []
    base = default_launch(dev)
    ref = None
    for spec in HEADS:
        cfg = _cfg(base, spec)

        def run(cfg=cfg):
            return _bwd_impl(None, dv, dqs, h, gamma, pos, e, s, False, 1e4, 1, True, cfg, bias=bias)

        out = run()
        ref = ref or out
        row = {"case": "heads bwd + bias", "config": spec or "default", "ms": graph_ms(run),
               "dh_equal": bool(torch.equal(out[0], ref[0])),
               "dsums_max_rel_diff": max(_rel(x, y) for x, y in zip(out[1:], ref[1:]))}
        if not spec:
            row["ms_no_bias"] = graph_ms(lambda: _bwd_impl(None, dv, dqs, h, gamma, pos, e, s, False, 1e4, 1, True,
                                                           cfg))
        rows.append(row)
        print(json.dumps(row), flush=True)
    u, av, dy, bu = rnd(TT, e), rnd(TT, e), rnd(TT, e), torch.randn(e, generator=g, device=dev)
    gbase, gref = glu_ops.default_launch(dev), None
    try:
        for rb in GATE:
            glu_ops.default_launch = lambda device, rb=rb: replace(gbase, rb=rb)
            out = glu_ops.gated_bwd.fn(dy, u, av, 0, bu)
            gref = gref or out
            row = {"case": "gate bwd + bias", "config": f"rb={rb}", "ms": graph_ms(lambda: glu_ops.gated_bwd.fn(
                dy, u, av, 0, bu)), "du_equal": bool(torch.equal(out[0], gref[0])),
                   "dbias_max_rel_diff": _rel(out[2], gref[2])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        glu_ops.default_launch = lambda device: gbase
    rows.append({"case": "gate bwd, no bias", "ms": graph_ms(lambda: glu_ops.gated_bwd.fn(dy, u, av, 0, None))})
    rows.append({"case": "bias GEMV [TT, e + s] (replaced)", "ms": graph_ms(lambda: torch.mv(h[0].t(),
                                                                                           h.new_ones(TT)))})
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
           "tokens": TT, "e": e, "s": s, "nh": nh, "dtype": str(dt)}
    with open(a.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(json.dumps(rows[-2:]))


if __name__ == "__main__":
    main()
