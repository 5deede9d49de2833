"""A/B of GAU's packed paths in whole training steps (one process, one GPU): ``flash-quad-base`` and ``flash-base`` (``--presets``)
``lintime train`` steps (forward, backward, clip, AdamW; bf16 autocast) on packed batches of ``--tokens`` tokens laid
out like ``lintime train``'s -- ``mixed``: rows of ``T`` tokens, three in four one document, the fourth three -- and
``uniform`` -- every row one document (``lintime bench model``'s batches).  Configurations:

* ``default``: the defaults (session 11: mixed rows by the masked slab path where its work rule says so; a packed
  call's split and tables cached per ``cu_seqlens`` tensor, so only the first GAU call of a step reads it);
* ``unmasked``: ``Blocks.slab_masked = 0`` (mixed rows to the tiled kernels), cache on;
* ``session10``: ``slab_masked = 0`` and no cache (every call reads and checks ``cu_seqlens`` on the host: the code of
  session 10).

``flash-base`` is a FLASH (mixed chunk) model: ``unmasked`` equals ``default`` there; ``session10`` shows what the
cache of mixed chunk's packed plan and of the ``cu_seqlens`` check gives.  The anchor in the same run:
``transformer-pp-base`` (softmax attention on PyTorch SDPA, same batches, defaults).

Median step time of ``--steps`` steps after ``--warmup``; JSON to ``--out``.  Usage::

    PYTHONPATH=$PWD python3 benchmarks/ab_gau_packed_train.py --Ts 2048,4096,8192 --out $OUT/ab_packed_train.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch


def batch(rows: int, T: int, vocab: int, layout: str, device, seed: int = 0):
    from lintime.data.packing import Batch

    lens = []
    for r in range(rows):
        lens += [T] if (r % 4 or layout == "uniform") else [T // 2, T // 3, T - T // 2 - T // 3]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T + 1), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).view(rows, T)
    pos = torch.cat([torch.arange(n) for n in lens]).view(rows, T)
    return Batch(input_ids=ids[:, :-1].contiguous().to(device), targets=ids[:, 1:].contiguous().to(device),
                 cu_seqlens=cu, doc_ids=doc, position_ids=pos, row_ids=torch.arange(rows),
                 epochs=torch.zeros(rows, dtype=torch.long))


def main():
    from lintime.bench.model import build_model, preset_config, train_step_fn
    from lintime.ops.gau.triton import gau as g

    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="flash-quad-base,flash-base,transformer-pp-base",
                    help="comma-separated; presets of other families (the anchor: transformer-pp-base, softmax "
                         "attention on PyTorch SDPA) are timed with the defaults only")
    ap.add_argument("--Ts", default="2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (the A/B); cpu only checks that the script runs")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ab_gau_packed_train.json"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    from lintime.ops import utils as ou
    from lintime.ops.mixed_chunk.triton import mixed_chunk as mc

    real_defaults, real_cache = g.default_blocks, ou.packed_cache

    def configure(name):
        g.default_blocks = real_defaults
        g.packed_cache = mc.packed_cache = ou.packed_cache = real_cache
        if name in ("unmasked", "session10"):
            g.default_blocks = lambda *a: dataclasses.replace(real_defaults(*a), slab_masked=0)
        if name == "session10":  # no cache anywhere: every call reads and checks cu_seqlens on the host
            g.packed_cache = mc.packed_cache = ou.packed_cache = lambda cu, key: {}

    out = []
    for preset in args.presets.split(","):
        cfg, _ = preset_config(preset, max(int(t) for t in args.Ts.split(",")))
        model = build_model(cfg, dev)
        model.train()
        ours = preset.startswith("flash")
        for T in (int(t) for t in args.Ts.split(",")):
            for layout in ("mixed", "uniform"):
                b = batch(args.tokens // T, T, cfg.vocab_size, layout, dev)
                names = ("default", "unmasked", "session10") if layout == "mixed" else ("default", "session10")
                for name in names if ours else ("default",):
                    configure(name)
                    step, _opt = train_step_fn(model, b, torch.bfloat16 if dev.type == "cuda" else None)
                    for _ in range(args.warmup):
                        step()
                    sync()
                    times = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        step()
                        sync()
                        times.append((time.perf_counter() - t0) * 1e3)
                    row = {"preset": preset, "T": T, "rows": args.tokens // T, "layout": layout, "config": name,
                           "step_ms_median": statistics.median(times), "step_ms_min": min(times)}
                    out.append(row)
                    print(row, flush=True)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    configure("default")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(args.out, "w") as f:
        json.dump({"env": env, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
