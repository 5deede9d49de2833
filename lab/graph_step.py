"""The trainer's step eager vs captured in one CUDA graph (lintime/training/graphed.py), per preset and T.

32768 tokens per step (rows = 32768 / T, one micro-batch), random tokens, bf16 autocast, clip 1.0, fused AdamW.
Three forms of one step, each from the same initial weights on the same batch:

* ``eager``: what ``lintime train`` runs today (``forward_backward`` on the packed layout with row-start
  ``cu_seqlens``, ``clip_grad_norm_``, AdamW), as ``lintime bench model`` times it;
* ``eager_rows``: the graph's step run eagerly (``GraphedStep(capture=False)``: ``[rows, T]`` without ``cu_seqlens``,
  the lr a device tensor) -- separates the layout's cost from the launches';
* ``graph``: ``GraphedStep`` replays (capture time reported apart).

Median ms of 8 steps after 3 warm-up (each timed between two device synchronisations), tokens/s, the first step's
loss of each form and the peak memory.

    PYTHONPATH=. python3 lab/graph_step.py [--presets flash-base] [--T 2048,8192] [--out graph_step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lintime.bench.common import build_model, preset_config
from lintime.bench.measure import call_times_ms
from lintime.bench.model import random_batch
from lintime.training.graphed import GraphedStep
from lintime.training.step import forward_backward

TOKENS = 32768
WARMUP, STEPS = 3, 8
LR, CLIP = 1e-4, 1.0


def run_form(form: str, preset: str, T: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(preset_config(preset, T)[0], dev)
    model.train()
    rows = TOKENS // T
    batch = random_batch(rows, T, model.config.vocab_size, dev)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=LR, fused=True)
    if form == "eager":
        def step() -> float:
            loss = forward_backward(model, batch, micro_rows=rows, autocast=torch.bfloat16)[0]
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        graphed = GraphedStep(model, opt, rows=rows, context_len=T, clip=CLIP, autocast=torch.bfloat16,
                              capture=form == "graph")

        def step() -> float:
            out = graphed.step(batch.input_ids, batch.targets, LR)
            if out is None:
                raise RuntimeError(f"capture failed: {graphed.failed}")
            return out.loss
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    first = float(step())  # the graph form captures here (warm-up + capture + the first replay)
    first_s = time.perf_counter() - t0
    call_times_ms(step, WARMUP - 1, dev)
    ms = call_times_ms(step, STEPS, dev)
    med = statistics.median(ms)
    out = {"form": form, "preset": preset, "T": T, "rows": rows, "first_loss": first, "first_call_s": round(first_s, 2),
           "step_ms": round(med, 2), "min_ms": round(min(ms), 2), "tokens_per_s": round(TOKENS / med * 1e3),
           "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)}
    del model, opt, step
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="flash-base")
    ap.add_argument("--T", default="2048,8192")
    ap.add_argument("--forms", default="eager,eager_rows,graph")
    ap.add_argument("--out", default="graph_step.json")
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        for T in (int(t) for t in args.T.split(",")):
            for form in args.forms.split(","):
                try:
                    r = run_form(form, preset, T)
                except Exception as err:  # one failing form must not hide the others' numbers
                    r = {"form": form, "preset": preset, "T": T, "error": str(err).splitlines()[0][:300]}
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{'preset':<12} {'T':>6} {'form':<11} {'ms':>8} {'tok/s':>9} {'vs eager':>8} {'loss1':>9} {'GiB':>6}")
    for r in rows:
        base = next((b for b in rows if b["preset"] == r["preset"] and b["T"] == r["T"] and b["form"] == "eager"
                     and "step_ms" in b), None)
        if "error" in r:
            print(f"{r['preset']:<12} {r['T']:>6} {r['form']:<11} error: {r['error'][:80]}")
            continue
        speed = f"{base['step_ms'] / r['step_ms']:.2f}x" if base else "-"
        print(f"{r['preset']:<12} {r['T']:>6} {r['form']:<11} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9,} {speed:>8} "
              f"{r['first_loss']:>9.5f} {r['peak_gib']:>6.1f}")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
