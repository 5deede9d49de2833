"""GAU (Triton, with its Toeplitz bias and its gradient) against SDPA causal H16 D64, CUDA-graph fwd / fwd+bwd at
T = 2k / 4k / 8k, 32k tokens per batch, bf16: the GAU rows of ``lintime bench ops --cases flash.graph`` in ~10 s of
device time (session 9 re-measured GAU with it after the bias-tile change).  Writes ``$OUT/gau_quick.json``.

Usage (GPU): ``OUT=. PYTHONPATH=$PWD python3 benchmarks/exp_gau_sdpa_quick.py``
"""

import json
import os
import time

import torch
import torch.nn.functional as F

from lintime.bench.measure import fwd_fwdbwd_graph_ms
from lintime.ops.gau.triton import triton_gau_attention


def main():
    rows = []
    bf = torch.bfloat16
    for T in (2048, 4096, 8192):
        B = 32768 // T
        q = (torch.randn(B, T, 1, 128, device="cuda", dtype=bf) * 0.5).requires_grad_()
        k = (torch.randn(B, T, 1, 128, device="cuda", dtype=bf) * 0.5).requires_grad_()
        v = torch.randn(B, T, 1, 2048, device="cuda", dtype=bf).requires_grad_()
        rb = (torch.randn(1, 2 * T - 1, device="cuda", dtype=bf) * 0.1).requires_grad_()
        g = fwd_fwdbwd_graph_ms(lambda a, b, c, d: triton_gau_attention(a, b, c, rel_bias=d, scale=1 / 128),
                                [q, k, v, rb], rep=30)
        del q, k, v
        qs, ks, vs = [torch.randn(B, 16, T, 64, device="cuda", dtype=bf).requires_grad_() for _ in range(3)]
        s = fwd_fwdbwd_graph_ms(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                                [qs, ks, vs], rep=30)
        rows.append({"T": T, "B": B, "gau": g, "sdpa": s, "ratio_fwdbwd": g[1] / s[1]})
        print(rows[-1], flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": torch.cuda.get_device_name(),
           "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "gau_quick.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
