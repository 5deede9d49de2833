"""Tile A/B of the many-token quantisation kernel (``lintime.ops.vq.triton.quantize.assign_codes``) at vq-base's
shape (32768 keys, H = 1, K = 128, S = 512 fp32 codes, bf16 keys), against the PyTorch path it replaces (fp32 GEMM
with the squared norms, argmin, gather): median device ms (CUDA-graph replays) and whether the codes agree.

GPU: ``PYTHONPATH=. python3 lab/vq_assign_ab.py --out f.json``."""

from __future__ import annotations

import argparse
import json

import torch

from lintime.bench.measure import graph_ms
from lintime.layers.vq import VQAttention
from lintime.ops.vq.triton.quantize import assign_codes

VARIANTS = [(64, 64, 4), (128, 64, 8), (64, 128, 4), (32, 128, 4), (64, 32, 4), (128, 32, 4), (32, 64, 4), (128, 64, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    N, H, K, S = 32768, 1, 128, 512
    k = (torch.randn(N, H, K, generator=g) * K**-0.5).cuda().bfloat16()
    cb = (torch.randn(H, S, K, generator=g) * K**-0.5).cuda()
    c2 = cb.pow(2).sum(-1)[:, None, :]
    ref_codes, _, _ = VQAttention.quantize(k.view(1, N, H, K), cb, c2)  # CUDA keys: the layer takes the kernel
    with torch.no_grad():
        dist = torch.baddbmm(c2, k.float().permute(1, 0, 2), cb.transpose(1, 2), alpha=-2.0)
        torch_codes = dist.argmin(-1).view(H, N).t()
    rows = [dict(variant="torch", ms=graph_ms(lambda: torch.baddbmm(c2, k.float().permute(1, 0, 2), cb.transpose(
        1, 2), alpha=-2.0).argmin(-1)))]
    print(rows[0], flush=True)
    for t in VARIANTS:
        try:
            codes, _ = assign_codes(k, cb, c2, t)
            rows.append(dict(variant=f"BM{t[0]} BS{t[1]} w{t[2]}", ms=graph_ms(lambda t=t: assign_codes(k, cb, c2, t)),
                             codes_differ=int((codes != torch_codes).sum())))
        except Exception as e:  # noqa: BLE001 -- a tile that does not fit is a result
            rows.append(dict(variant=f"BM{t[0]} BS{t[1]} w{t[2]}", error=f"{type(e).__name__}: {str(e)[:120]}"))
        print(rows[-1], flush=True)
    print("layer path codes differ from torch:", int((ref_codes.view(N, H) != torch_codes).sum()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
