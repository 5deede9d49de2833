"""torch.compile of whole models on a GPU: graph breaks (torch._dynamo.explain) and eager vs compiled step ms.

For each preset at context T (32768 tokens per step, one document per row, packed as the trainer packs them,
bf16 autocast): the graphs and graph breaks of the model's forward with loss (the first reasons), then the
trainer's step (forward_backward, clip, fused AdamW; median of 5 after 3 warm-up) eager and compiled with
lintime.training.compile.CompiledModel (fullgraph=True, else graph breaks after a notice), and the first
step's loss of both (same weights, same batch).

    PYTHONPATH=. python3 lab/compile_check.py [--presets flash-base,gla-base,transformer-pp-base] [--T 8192]
        [--out compile_check.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lintime.bench.common import build_model, preset_config
from lintime.bench.model import random_batch
from lintime.training.compile import CompiledModel
from lintime.training.step import forward_backward, packed_rows

TOKENS = 32768


def explain(model, batch) -> dict:
    ids, targets, cu = packed_rows(batch, 0, batch.input_ids.shape[0])
    dev = next(model.parameters()).device
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(model)(ids.to(dev), cu_seqlens=cu.to(dev), targets=targets.view(1, -1).to(dev))
    reasons = []
    for b in ex.break_reasons:
        where = f"{b.user_stack[-1].filename.split('lintime/')[-1]}:{b.user_stack[-1].lineno}" if b.user_stack else "?"
        line = f"{str(b.reason).splitlines()[0][:120]} @ {where}"
        if line not in reasons:
            reasons.append(line)
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons[:5]}


def time_steps(model, fwd, batch) -> tuple[float, float]:
    """(median ms of the trainer's step, the first step's loss)."""
    rows = batch.input_ids.shape[0]
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, fused=True)

    def step() -> float:
        loss = forward_backward(fwd, batch, micro_rows=rows, autocast=torch.bfloat16)[0]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = step()
    for _ in range(2):
        step()
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[2] * 1e3, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flash-base,gla-base,transformer-pp-base")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "T": args.T, "rows": {}}
    for preset in args.presets.split(","):
        cfg, _ = preset_config(preset, args.T, dev)
        batch = random_batch(TOKENS // args.T, args.T, cfg.vocab_size, dev)
        torch.manual_seed(0)
        model = build_model(cfg, dev).train()
        row = {"explain": explain(model, batch)}
        print(f"{preset} T={args.T}: {row['explain']['graphs']} graphs, {row['explain']['breaks']} breaks", flush=True)
        for r in row["explain"]["reasons"]:
            print(f"    {r}", flush=True)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        row["eager_ms"], row["eager_loss"] = time_steps(model, model, batch)
        model.load_state_dict(init)
        torch._dynamo.reset()
        compiled = CompiledModel(model, lambda line: print("    " + line, flush=True), "the training step")
        t = time.perf_counter()
        row["compiled_ms"], row["compiled_loss"] = time_steps(model, compiled, batch)
        row["compile_and_time_s"] = time.perf_counter() - t
        row["fullgraph"] = compiled.fullgraph
        print(f"    eager {row['eager_ms']:.1f} ms, compiled{' (fullgraph)' if compiled.fullgraph else ''} "
              f"{row['compiled_ms']:.1f} ms ({row['eager_ms'] / row['compiled_ms']:.2f}x); first-step loss "
              f"{row['eager_loss']:.5f} vs {row['compiled_loss']:.5f}", flush=True)
        out["rows"][preset] = row
        del model, compiled, batch, init
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
