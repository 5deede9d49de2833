"""Launch sweep of the cross-entropy's per-row kernel (``ce_rows_kernel``) on one chunk of flash-base's loss: ``[4096,
32000]`` bf16 logits, targets uniform, the gradient written in place (the step the chunk loop runs 8 times at 32k
tokens).  ``CrossEntropyLaunch(block_v, num_warps)``: ``block_v >= V`` keeps the row in registers (one read), smaller blocks
take two sweeps (online softmax, then the gradient: the second read mostly from L2).  Device ms (``do_bench``
median, L2 flushed between calls), the rate of the 2 x 262 MB the chunk must move, and each launch's loss and
gradient against the default's (largest relative difference).  A device copy of the same bytes is the reference.

    PYTHONPATH=. python3 lab/ce_rows_sweep.py [--out f.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from lintime.bench.measure import git_commit, median_ms
from lintime.modules.cross_entropy.triton.launch import CrossEntropyLaunch, default_launch
from lintime.modules.cross_entropy.triton.ops import triton_rows

LAUNCHES = [(32768, 32), (32768, 16), (16384, 16), (16384, 32), (8192, 8), (8192, 16), (4096, 4), (4096, 8),
            (2048, 4), (2048, 2), (1024, 4), (1024, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="ce_rows_sweep.json")
    a = ap.parse_args()
    dev, n, V = torch.device("cuda"), 4096, 32000
    g = torch.Generator(device=dev).manual_seed(0)
    z0 = (3 * torch.randn(n, V, generator=g, device=dev)).to(torch.bfloat16)
    y = torch.randint(0, V, (n,), generator=g, device=dev)
    scale = torch.full((), 1.0 / 32768, device=dev)
    nbytes = 2 * z0.numel() * z0.element_size()
    rows, ref = [], None
    for bv, w in LAUNCHES:
        launch = CrossEntropyLaunch(bv, w)
        z, loss = z0.clone(), torch.empty(n, device=dev)
        try:
            triton_rows(z, y, scale, loss, -100, 0.0, True, launch)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a launch the device cannot run is a row, not a stop
            rows.append({"block_v": bv, "num_warps": w, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        ref = ref or (loss, z)
        zt = z0.clone()
        ms = median_ms(lambda: triton_rows(zt, y, scale, loss, -100, 0.0, True, launch))
        rows.append({"block_v": bv, "num_warps": w, "default": launch == default_launch(), "ms": ms, "tb_s": nbytes / ms / 1e9,
                     "loss_max_rel_diff": float(((loss - ref[0]).abs().max() / ref[0].abs().max())),
                     "grad_max_abs_diff": float((z.float() - ref[1].float()).abs().max()),
                     "grad_max": float(ref[1].float().abs().max())})
        print(json.dumps(rows[-1]), flush=True)
    zc = torch.empty_like(z0)
    copy_ms = median_ms(lambda: zc.copy_(z0))
    rows.append({"case": "copy of the chunk (read + write)", "ms": copy_ms, "tb_s": nbytes / copy_ms / 1e9})
    print(json.dumps(rows[-1]), flush=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(), "rows": n,
           "V": V, "dtype": "bfloat16"}
    with open(a.out, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
