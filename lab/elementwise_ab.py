"""A/B of two elementwise kernels of the training step, one process, CUDA events, medians.

    python lab/elementwise_ab.py [--reps 30] [--out elementwise_ab.json]

* ``ce_rows``: the fused loss's per-row kernel on one chunk of logits ``[4096, 32000]`` bf16 (the chunk the loss
  uses at vocab 32000), the row kept in registers (``reuse_row``) against two sweeps over it;
* ``glu``: ``glu_activation`` forward + backward, the Triton kernels against the PyTorch composite, at gla-base's
  SwiGLU (``[32768, 2 x 2048]``) and transformer-pp-base's GEGLU (``[32768, 2 x 3072]``), bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def _time(fn, reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="elementwise_ab.json")
    args = ap.parse_args()
    from lintime.ops import glu_activation
    from lintime.ops.cross_entropy.triton.ops import Launch, triton_rows

    dev = torch.device("cuda")
    rows = []
    z0 = torch.randn(4096, 32000, device=dev).bfloat16()
    y = torch.randint(0, 32000, (4096,), device=dev)
    scale, loss = torch.tensor(1.0, device=dev), torch.empty(4096, device=dev)
    z = z0.clone()
    for reuse in (False, True):
        launch = Launch(reuse_row=reuse)
        ms = _time(lambda: (z.copy_(z0), triton_rows(z, y, scale, loss, -100, 0.0, True, launch)), args.reps)
        copy_ms = _time(lambda: z.copy_(z0), args.reps)
        rows.append(dict(case="ce_rows", variant="reuse_row" if reuse else "two_sweeps", shape=[4096, 32000],
                         ms=round(ms - copy_ms, 4), note="minus the time of the copy that restores the logits"))
    for name, N, e, act in (("gla-base swiglu", 32768, 2048, "silu"), ("tpp-base geglu", 32768, 3072, "gelu")):
        h = torch.randn(N, 2 * e, device=dev).bfloat16().requires_grad_()
        dy = torch.randn(N, e, device=dev).bfloat16()
        for backend in ("chunk", "triton"):
            def step():
                h.grad = None
                glu_activation(h, activation=act, backend=backend).backward(dy)

            fwd = _time(lambda: glu_activation(h.detach(), activation=act, backend=backend), args.reps)
            rows.append(dict(case="glu", variant=backend, preset=name, shape=[N, 2 * e], fwd_ms=round(fwd, 4),
                             fwd_bwd_ms=round(_time(step, args.reps), 4)))
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for r in rows:
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
