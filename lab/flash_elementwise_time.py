"""Device time (graph replay, median) of the FLASH layer's bandwidth-bound backward pieces at flash-base's shape,
for the ``lintime`` on ``PYTHONPATH`` (run once per snapshot to A/B two commits on one GPU):

* the heads op's backward launcher (``split_heads``, ``gating=False``, ``W = e + s``, every head with a gradient),
  with ``bias`` when the snapshot's op takes one;
* the gate's backward launcher (``gated_bwd``), with ``bias`` when the snapshot's op takes one;
* the dense layers' bias gradients as the GEMV of :mod:`lintime.layers._split_linear` (``[TT, e]``, ``[TT, e + s]``,
  ``[TT, d]``), what the fused bias gradients replace.

    PYTHONPATH=<snapshot> python3 lab/flash_elementwise_time.py --tag new [--tokens 32768 --e 1536 --s 128 --d 768]

Prints one JSON line (``ms`` per piece).
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch

from lintime.bench.measure import graph_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--e", type=int, default=1536)
    ap.add_argument("--s", type=int, default=128)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--nh", type=int, default=4)
    a = ap.parse_args()
    from lintime.modules.glu.triton.ops import gated_bwd
    from lintime.modules.heads.triton.heads import _bwd_impl

    dev, dt, TT, e, s, nh = torch.device("cuda"), torch.bfloat16, a.tokens, a.e, a.s, a.nh
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    h = 2 * rnd(1, TT, e + s)
    gamma = torch.randn(nh, s, generator=g, device=dev)
    pos = torch.arange(TT, device=dev)[None]
    dv, dqs = rnd(1, TT, e), [rnd(1, TT, 1, s) for _ in range(nh)]
    u, av, dy = rnd(TT, e), rnd(TT, e), rnd(TT, e)
    out = {"tag": a.tag, "device": torch.cuda.get_device_name(), "tokens": TT, "e": e, "s": s, "ms": {}}
    ms = out["ms"]
    heads_bias = "bias" in inspect.signature(_bwd_impl).parameters
    gated_bias = "bias" in inspect.signature(getattr(gated_bwd, "fn", gated_bwd)).parameters
    ms["heads_bwd"] = graph_ms(lambda: _bwd_impl(None, dv, dqs, h, gamma, pos, e, s, False, 1e4, 1, True))
    if heads_bias:
        bvz = torch.randn(e + s, device=dev)
        ms["heads_bwd+bias"] = graph_ms(lambda: _bwd_impl(None, dv, dqs, h, gamma, pos, e, s, False, 1e4, 1, True,
                                                          bias=bvz))
    ms["gated_bwd"] = graph_ms(lambda: gated_bwd(dy, u, av, 0))
    if gated_bias:
        bu = torch.randn(e, device=dev)
        ms["gated_bwd+bias"] = graph_ms(lambda: gated_bwd(dy, u, av, 0, bu))
    for name, n in (("bias_gemv_u", e), ("bias_gemv_vz", e + s), ("bias_gemv_out", a.d)):
        x = rnd(TT, n)
        ms[name] = graph_ms(lambda: torch.mv(x.t(), x.new_ones(TT)))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
