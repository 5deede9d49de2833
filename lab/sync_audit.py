"""Where a training step (or a decode step) synchronises the host with the device: every synchronising CUDA call of
one step, counted by the Python line that made it (``torch.cuda.set_sync_debug_mode``), plus the host time of the
step's Python and launches (CPU wall time of the step with the device work excluded by a final synchronise).

    python3 lab/sync_audit.py --presets flash-base,gla-base --contexts 2048,32768 [--out sync.json]

A step with no synchronising call can be captured in a CUDA graph and lets the host run ahead of the device.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

import torch

from lintime.bench.model import build_model, preset_config, random_batch, train_step_fn


def _site(stack) -> str:
    """The innermost frame inside lintime (else the innermost frame outside torch)."""
    frames = [f for f in stack if "/lintime/" in f.filename and "sync_audit" not in f.filename]
    if not frames:
        frames = [f for f in stack if "/torch/" not in f.filename] or stack
    f = frames[-1]
    return f"{f.filename.split('/lintime/')[-1]}:{f.lineno} {f.line}"


def audit(preset: str, T: int, tokens: int) -> dict:
    dev = torch.device("cuda")
    cfg, _ = preset_config(preset, T)
    model = build_model(cfg, dev)
    model.train()
    batch = random_batch(max(tokens // T, 1), T, cfg.vocab_size, dev)
    step, _ = train_step_fn(model, batch, torch.bfloat16)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_site(traceback.extract_stack()[:-1])] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            step()
            host_s = time.perf_counter() - t0
            torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    torch.cuda.synchronize()
    return {"preset": preset, "T": T, "syncs": sum(sites.values()), "host_ms_until_return": host_s * 1e3,
            "sites": sites.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="flash-base,gla-base")
    ap.add_argument("--contexts", default="2048,32768")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for p in a.presets.split(","):
        for T in (int(t) for t in a.contexts.split(",")):
            r = audit(p, T, a.tokens)
            rows.append(r)
            print(f"{p} T={T}: {r['syncs']} synchronising calls; step returned after {r['host_ms_until_return']:.1f} ms")
            for site, n in r["sites"]:
                print(f"   {n:4d}  {site}")
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
