"""A/B of the GLU activation, one process, medians of :func:`lintime.bench.measure.median_ms`.

    python lab/elementwise_ab.py [--out elementwise_ab.json]

``glu_activation`` forward + backward, the Triton kernels against the PyTorch composite, at gla-base's SwiGLU
(``[32768, 2 x 2048]``) and transformer-pp-base's GEGLU (``[32768, 2 x 3072]``), bf16.  (At commit 8ca5a4e it also
timed the loss's row kernel with the row kept in registers against two sweeps: 0.222 vs 0.258 ms per
``[4096, 32000]`` bf16 chunk, H200; the two-sweep form of a one-block row is gone since.)
"""

from __future__ import annotations

import argparse
import json

import torch

from lintime.bench.measure import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="elementwise_ab.json")
    args = ap.parse_args()
    from lintime.modules import glu_activation

    dev = torch.device("cuda")
    rows = []
    for name, N, e, act in (("gla-base swiglu", 32768, 2048, "silu"), ("tpp-base geglu", 32768, 3072, "gelu")):
        h = torch.randn(N, 2 * e, device=dev).bfloat16().requires_grad_()
        dy = torch.randn(N, e, device=dev).bfloat16()
        for backend in ("chunk", "triton"):
            def step():
                h.grad = None
                glu_activation(h, activation=act, backend=backend).backward(dy)

            fwd = median_ms(lambda: glu_activation(h.detach(), activation=act, backend=backend))
            rows.append(dict(case="glu", variant=backend, preset=name, shape=[N, 2 * e], fwd_ms=round(fwd, 4),
                             fwd_bwd_ms=round(median_ms(step), 4)))
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for r in rows:
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
