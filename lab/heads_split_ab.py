"""A/B of the FLASH heads hand-off to the attention: ``gau_heads`` returning one ``[B, T, nh, s]`` tensor that the
layer splits into ``nh`` contiguous ``[B, T, 1, s]`` copies (``_SplitHeads``: ``nh`` copies forward, one ``cat``
backward) against ``gau_heads(split_heads=True)``, whose kernels write and read the ``nh`` tensors directly.

    PYTHONPATH=. python3 lab/heads_split_ab.py [--tokens 32768] [--e 1536] [--s 128] [--nh 4] [--out f.json]

FLASH's new call: ``gating=False`` on the ``v, z`` part (``W = e + s``), bf16, every head with a gradient.  Both
variants are run once and compared bit for bit (``v``, the heads, ``dh``, ``dgamma``, ``dbeta``), then timed in
interleaved rounds: device ms (median of :func:`lintime.bench.measure.median_ms` per round) and wall ms per call
with the device synchronised around it (:func:`lintime.bench.measure.call_times_ms`: host launches included), for
the forward (grad mode on, as in training) and forward + backward.  A second table times the backward launcher
alone per ``HeadsLaunch.rb`` (row blocks per heads program: fewer dgamma / dbeta partial rows; ``rb = 1`` is one
partial row per 8-row block, as before) and, for reference, the former fold of those partial rows by two
``torch.sum(0)`` calls.  CPU smoke test of the code paths (interpreter, tiny fp32 shape, no timing):
``PYTHONPATH=. python3 lab/heads_split_ab.py --smoke``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from lintime.bench.measure import call_times_ms, git_commit, median_ms
from lintime.modules import gau_heads
from lintime.modules.heads.triton.heads import _bwd_impl, _fwd_impl, default_launch


class _SplitHeads(torch.autograd.Function):
    """The FLASH layer's split (lintime/layers/flash.py before ``split_heads``): ``nh`` contiguous copies forward,
    one ``cat`` of the ``nh`` gradients backward."""

    @staticmethod
    def forward(ctx, heads):
        ctx.set_materialize_grads(False)
        return tuple(heads[:, :, i : i + 1].contiguous() for i in range(heads.shape[2]))

    @staticmethod
    def backward(ctx, *grads):
        ref = next((g for g in grads if g is not None), None)
        if ref is None:
            return None
        return torch.cat([g if g is not None else torch.zeros_like(ref) for g in grads], dim=2)


def _heads(mode, h, gamma, beta, pos, e, s):
    """``(v, the nh [B, T, 1, s] heads)`` of one variant."""
    if mode == "stacked+copies":
        _, v, heads = gau_heads(h, gamma, beta, pos, e=e, s=s, gating=False, backend="triton")
        return v, _SplitHeads.apply(heads)
    _, v, heads = gau_heads(h, gamma, beta, pos, e=e, s=s, gating=False, split_heads=True, backend="triton")
    return v, heads


MODES = ("stacked+copies", "split_heads")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--e", type=int, default=1536)
    ap.add_argument("--s", type=int, default=128)
    ap.add_argument("--nh", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--rbs", default="1,4,16,64", help="HeadsLaunch.rb values of the backward-launcher table")
    ap.add_argument("--configs", default="", help="HeadsLaunch variants for the backward-launcher table instead of "
                    "--rbs: ';'-separated 'field=value,...' (e.g. 'rb=16;rb=8,bth=16;bt=16,warps=8')")
    ap.add_argument("--out", default="heads_split_ab.json")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny fp32 shape, checks only")
    a = ap.parse_args()
    if a.smoke:
        dev, dt, a.tokens, a.e, a.s, a.rounds = torch.device("cpu"), torch.float32, 40, 20, 16, 1
    else:
        dev, dt = torch.device("cuda"), torch.bfloat16
    T, e, s, nh = a.tokens, a.e, a.s, a.nh
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    h = (2 * rnd(1, T, e + s)).requires_grad_()
    gamma = torch.randn(nh, s, generator=g, device=dev).requires_grad_()  # fp32 parameters, as under autocast
    beta = torch.randn(nh, s, generator=g, device=dev).requires_grad_()
    pos = torch.arange(T, device=dev)[None]
    dv, dqs = rnd(1, T, e), [rnd(1, T, 1, s) for _ in range(nh)]
    leaves = [h, gamma, beta]

    def fwd(mode):
        return lambda: _heads(mode, h, gamma, beta, pos, e, s)

    def fwdbwd(mode):
        def step():
            v, heads = _heads(mode, h, gamma, beta, pos, e, s)
            return torch.autograd.grad([v, *heads], leaves, [dv, *dqs])

        return step

    # bit for bit: the same kernels, only the heads' addresses differ
    res = {}
    for mode in MODES:
        v, heads = fwd(mode)()
        res[mode] = [v, *heads, *fwdbwd(mode)()]
    names = ["v", *(f"head{n}" for n in range(nh)), "dh", "dgamma", "dbeta"]
    equal = {n: bool(torch.equal(x, y)) for n, x, y in zip(names, *res.values())}
    print("bitwise equal:", all(equal.values()), "" if all(equal.values()) else equal, flush=True)

    rows = []
    if not a.smoke:
        times = {(m, k): {"dev": [], "wall": []} for m in MODES for k in ("fwd", "fwd+bwd")}
        for r in range(a.rounds + 1):  # round 0: warm-up (compiles), not kept
            for m in MODES:
                for k, fn in (("fwd", fwd(m)), ("fwd+bwd", fwdbwd(m))):
                    d = median_ms(fn, warmup=5, rep=20)
                    w = call_times_ms(fn, 20, dev)
                    if r:
                        times[(m, k)]["dev"].append(d)
                        times[(m, k)]["wall"] += w
        for (m, k), t in times.items():
            rows.append(dict(case=k, variant=m, dev_ms=round(statistics.median(t["dev"]), 4),
                             wall_ms=round(statistics.median(t["wall"]), 4)))
        print(f"\n{'case':8s} {'variant':16s} {'device ms':>10s} {'wall ms':>9s}")
        for row in rows:
            print(f"{row['case']:8s} {row['variant']:16s} {row['dev_ms']:10.4f} {row['wall_ms']:9.4f}")

    # the backward launcher per rb (dgamma / dbeta partial rows = cdiv(tokens, bth * rb))
    cfg0 = default_launch(dev)
    hd = h.detach()
    bwd_rows = []
    ref = None
    variants = [dict(kv.split("=") for kv in c.split(",")) for c in a.configs.split(";") if c] or \
        [{"rb": x} for x in a.rbs.split(",")]
    for var in variants:
        cfg = replace(cfg0, **{k: int(v) for k, v in var.items()})
        rb = cfg.rb

        def bwd(cfg=cfg):
            return _bwd_impl(None, dv, dqs, hd, gamma.detach(), pos, e, s, False, 10000.0, 1, True, cfg=cfg)

        out = bwd()
        ref = ref or out
        diff = max(float(((x - y).abs().max() / y.abs().max().clamp_min(1e-30))) for x, y in zip(out[1:3], ref[1:3]))
        row = dict(case="bwd launcher", rb=rb, config=",".join(f"{k}={v}" for k, v in var.items()),
                   partial_rows=-(-T // (cfg.bth * rb)), dh_equal=bool(torch.equal(out[0], ref[0])),
                   dparams_max_rel_diff=diff)
        if not a.smoke:
            row["dev_ms"] = round(statistics.median(median_ms(bwd, warmup=5, rep=20) for _ in range(a.rounds)), 4)
            fw = lambda cfg=cfg: _fwd_impl(hd, gamma.detach(), beta.detach(), pos, None, e, s, False, 10000.0, 1,  # noqa
                                            True, cfg=cfg)
            row["fwd_ms"] = round(median_ms(fw, warmup=5, rep=20), 4)
        bwd_rows.append(row)
    if not a.smoke:  # the former fold: two torch.sum(0) over one partial row per 8-row block
        part = torch.randn(2, -(-T // cfg0.bth), nh, s, device=dev)
        ms = median_ms(lambda: (part[0].sum(0), part[1].sum(0)), warmup=5, rep=20)
        bwd_rows.append(dict(case="former torch.sum fold", partial_rows=part.shape[1], dev_ms=round(ms, 4)))
    print(f"\n{'backward launcher':22s} {'partial rows':>12s} {'device ms':>10s}  dh equal  dparams rel diff")
    for row in bwd_rows:
        label = row.get("config") or row["case"]
        print(f"{label:22s} {row['partial_rows']:12d} {row.get('dev_ms', float('nan')):10.4f}  "
              f"{str(row.get('dh_equal', '')):8s}  {row.get('dparams_max_rel_diff', '')}  fwd {row.get('fwd_ms', '')}")

    env = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)", torch=torch.__version__,
               commit=git_commit(), dtype=str(dt), tokens=T, e=e, s=s, nh=nh, gating=False)
    with open(a.out, "w") as f:
        json.dump(dict(env=env, bitwise_equal=equal, rows=rows, bwd_rows=bwd_rows), f, indent=1)
    if not all(equal.values()):
        raise SystemExit("split_heads differs from the stacked heads + copies")


if __name__ == "__main__":
    main()
