"""The trainer's step with the backbone's residual adds fused into the norms (``Backbone.fused = True``, the
default) against the plain adds (``False``), same model and batch, interleaved in one process.

    PYTHONPATH=. python3 lab/residual_ab.py [--presets flash-base,gla-base] [--T 8192] [--tokens 32768] [--out f.json]

Per preset: the loss of one no-grad forward in each mode (they should agree to the last bits: the fused kernels do
the same fp32 operations), then rounds of 5 steps per mode (after 3 warm-up steps each); median ms, tokens/s and
peak memory per mode.  bf16 autocast, AdamW fused, as ``lintime bench model`` times the step.
"""

from __future__ import annotations

import argparse
import json

import torch

from ab import interleaved, line

from lintime.bench.model import build_model, preset_config, random_batch, train_step_fn

MODES = {"plain": False, "fused": True}


def run(preset: str, T: int, tokens: int, rounds: int, dev: torch.device = torch.device("cuda")) -> dict:
    cfg, _ = preset_config(preset, T)
    model = build_model(cfg, dev)
    batch = random_batch(tokens // T, T, cfg.vocab_size, dev)
    row = {"preset": preset, "T": T, "tokens": tokens, "device": torch.cuda.get_device_name()}
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        for mode, fused in MODES.items():
            model.backbone.fused = fused
            row[f"loss_{mode}"] = float(model(batch.input_ids, targets=batch.targets))
    model.train()
    step, _ = train_step_fn(model, batch, torch.bfloat16)
    row.update(interleaved(list(MODES), lambda m: setattr(model.backbone, "fused", MODES[m]), lambda m: step, tokens,
                           rounds))
    row["speedup"] = row["plain"]["ms"] / row["fused"]["ms"]
    print(line(f"{preset:14s} T={T:6d}", row), flush=True)
    del model, batch, step
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flash-base,gla-base")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [run(p, a.T, a.tokens, a.rounds) for p in a.presets.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
