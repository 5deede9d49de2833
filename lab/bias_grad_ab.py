"""A/B of the bias gradient of a dense layer's output gradient ``g [M, N]`` (bf16, the FLASH ``dense(x)`` parts at
32k tokens): ``g.sum(0)`` (what autograd's addmm backward does) against a GEMV with a ones vector, and the split
layer's whole backward (``dx``, ``dW``, ``db``) with each.  CUDA only.

    python3 lab/bias_grad_ab.py [--out bias_grad_ab.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from lintime.bench.measure import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for M, N in ((32768, 1536), (32768, 1664), (32768, 3200), (32768, 768)):
        g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        ones = torch.ones(M, device=dev, dtype=torch.bfloat16)
        ref = g.float().sum(0)
        cases = {
            "sum(0)": lambda: g.sum(0),
            "mv(g.t(), ones)": lambda: torch.mv(g.t(), ones),
            "ones @ g": lambda: ones[None] @ g,
            "sum(0, fp32 out)": lambda: g.sum(0, dtype=torch.float32),
        }
        for name, fn in cases.items():
            err = ((fn().float().reshape(-1) - ref).abs().max() / ref.abs().max()).item()
            ms = median_ms(fn)
            rows.append({"M": M, "N": N, "case": name, "ms": ms, "GBps": M * N * 2 / ms / 1e6, "rel_err": err})
            print(f"[{M}, {N}] {name:18s} {ms * 1e3:8.1f} us  {M * N * 2 / ms / 1e6:7.0f} GB/s  rel err {err:.1e}")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
