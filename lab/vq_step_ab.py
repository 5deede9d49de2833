"""vq-base's graphed training step (what ``lintime bench model`` times as ``vq-base@graph``), before / after the
layer's glue changes, in one process.

32768 tokens per step (rows = 32768 / T), random tokens, bf16 autocast, clip 1.0, fused AdamW, the step captured in
one CUDA graph (:func:`lintime.bench.model.graph_step_fn`).  Variants, each from the same initial weights:

* ``rel``: the library as it is (the XL bias passed to ``vq_attention`` as its relative table);
* ``dense_bias``: the layer's former path, the dense ``[B, T, H, 2L]`` bias built position by position (int64
  distances, masks, a gather: :func:`lintime.ops.vq.bias.dense_rel_bias`) and passed as ``bias``;
* ``old_glue``: ``dense_bias`` and the former output gate, SiLU then product (the straight-through /
  commitment-loss functions stay the new ones).

Median ms of ``--steps`` replays after 3 warm-up steps (each between two device synchronisations), tokens/s, the
first step's loss (the variants compute the same step: the losses agree to rounding) and the peak memory.  About
40-70 s on a warm H100 / H200 (three captures of vq-base at 8k).

    PYTHONPATH=. python3 lab/vq_step_ab.py [--preset vq-base] [--T 8192] [--variants rel,dense_bias,old_glue] \
        [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import lintime.layers.vq as vq_layer
from lintime.bench.common import build_model, preset_config
from lintime.bench.measure import call_times_ms
from lintime.bench.model import graph_step_fn, random_batch
from lintime.ops.vq.bias import dense_rel_bias, token_offsets

TOKENS = 32768
WARMUP = 3


@contextlib.contextmanager
def _dense_bias():
    """The layer's ``vq_attention`` given the dense bias instead of the relative table (the former path)."""
    real = vq_layer.vq_attention

    def with_dense(q, *args, rel_bias=None, initial_state=None, cu_seqlens=None, block_len, **kw):
        if rel_bias is not None:
            B, T = q.shape[:2]
            pos0 = None if initial_state is None else initial_state.pos
            kw["bias"] = dense_rel_bias(*rel_bias, token_offsets(B, T, block_len, cu_seqlens, pos0, q.device))
        return real(q, *args, initial_state=initial_state, cu_seqlens=cu_seqlens, block_len=block_len, **kw)

    vq_layer.vq_attention = with_dense
    try:
        yield
    finally:
        vq_layer.vq_attention = real


@contextlib.contextmanager
def _old_glue():
    """:func:`_dense_bias` plus the former output gate (SiLU then product; module global swapped)."""
    import torch.nn.functional as F

    saved = vq_layer.vq_gate
    vq_layer.vq_gate = lambda o, g: o * F.silu(g)
    try:
        with _dense_bias():
            yield
    finally:
        vq_layer.vq_gate = saved


def run(variant: str, preset: str, T: int, steps: int) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(preset_config(preset, T)[0], dev)
    model.train()
    rows = TOKENS // T
    batch = random_batch(rows, T, model.config.vocab_size, dev)
    ctx = {"dense_bias": _dense_bias, "old_glue": _old_glue}.get(variant, contextlib.nullcontext)()
    with ctx:
        step, _ = graph_step_fn(model, batch, torch.bfloat16)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        first = step()  # captures
        first_s = time.perf_counter() - t0
        call_times_ms(step, WARMUP - 1, dev)
        ms = call_times_ms(step, steps, dev)
    med = statistics.median(ms)
    out = {"variant": variant, "preset": preset, "T": T, "rows": rows, "first_loss": round(first, 5),
           "capture_s": round(first_s, 1), "step_ms": round(med, 2), "min_ms": round(min(ms), 2),
           "tokens_per_s": round(TOKENS / med * 1e3),
           "peak_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)}
    del model, step
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="vq-base")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--variants", default="rel,dense_bias,old_glue")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for v in args.variants.split(","):
        try:
            r = run(v, args.preset, args.T, args.steps)
        except Exception as err:  # one failing variant must not hide the other's numbers
            r = {"variant": v, "error": str(err).splitlines()[0][:300]}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
