"""gla-base's training step with the GLA layers' head norm and output gate in one op per direction
(``GatedLinearAttention.fused = True``, the default: :func:`lintime.modules.gated_normalize`) against the norm, then the
gate (``False``); everything else as ``lintime bench model`` runs it.  Same weights and batch, interleaved in one
process.

    PYTHONPATH=. python3 lab/gla_gate_ab.py [--T 2048,8192] [--tokens 32768] [--steps graph,eager] [--out f.json]

Per T and step kind (``graph``: the step captured in one CUDA graph, ``lintime.bench.model.graph_step_fn``; ``eager``:
``train_step_fn``): the loss of one no-grad forward per mode (they differ only by the bf16 rounding of the gate's
product: the fused op rounds once), then rounds of 5 steps per mode after 3 warm-up steps each; median ms, tokens/s,
peak memory.  A graph fixes its path when it captures, so the graph rows hold two models of the same weights, one per
mode; the eager rows flip the switch on one model.  bf16 autocast, fused AdamW.
"""

from __future__ import annotations

import argparse
import json

import torch

from ab import interleaved, line

from lintime.bench.common import build_model, preset_config
from lintime.bench.model import graph_step_fn, random_batch, train_step_fn
from lintime.layers.gla import GatedLinearAttention

MODES = {"plain": False, "fused": True}
PRESET = "gla-base"


def set_gate(model, fused: bool) -> None:
    """The GLA layers' gate path only (the norms, the residual adds and the ops keep theirs)."""
    for m in model.modules():
        if isinstance(m, GatedLinearAttention):
            m.fused = fused


def _models(cfg, dev, n: int) -> list:
    out = []
    for _ in range(n):
        torch.manual_seed(0)
        out.append(build_model(cfg, dev))
    return out


def run(T: int, tokens: int, kind: str, rounds: int, dev: torch.device = torch.device("cuda")) -> dict:
    cfg, _ = preset_config(PRESET, T)
    batch = random_batch(tokens // T, T, cfg.vocab_size, dev)
    row = {"preset": PRESET, "T": T, "tokens": tokens, "step": kind, "device": torch.cuda.get_device_name()}
    if kind == "graph":  # one model per mode: each graph captures its own path
        models = dict(zip(MODES, _models(cfg, dev, 2)))
        for mode, fused in MODES.items():
            set_gate(models[mode], fused)
    else:
        model = _models(cfg, dev, 1)[0]
        models = dict.fromkeys(MODES, model)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        for mode, fused in MODES.items():
            models[mode].eval()
            set_gate(models[mode], fused)
            row[f"loss_{mode}"] = float(models[mode](batch.input_ids, targets=batch.targets))
            models[mode].train()
    if kind == "graph":
        steps = {mode: graph_step_fn(models[mode], batch, torch.bfloat16)[0] for mode in MODES}
    else:
        steps = dict.fromkeys(MODES, train_step_fn(model, batch, torch.bfloat16)[0])
    row.update(interleaved(list(MODES), lambda m: set_gate(models[m], MODES[m]), steps.__getitem__, tokens, rounds))
    row["speedup"] = row["plain"]["ms"] / row["fused"]["ms"]
    print(line(f"{PRESET} {kind:5s} T={T:6d}", row), flush=True)
    del models, steps, batch
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="2048,8192")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--steps", default="graph,eager", help="step kinds: graph, eager")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [run(int(T), a.tokens, kind, a.rounds) for T in a.T.split(",") for kind in a.steps.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
