"""``lintime train`` as a user runs it: tokens/s of the trainer's own steady-state figure, per preset, context and
flags, every run a fresh ``lintime train`` process on the same corpus (the built-in one unless ``--corpus``).

A configuration is ``PRESET@T[:FLAGS]``, FLAGS a space-separated string of extra ``lintime train`` flags (none: the
default path).  Each run trains ``--steps`` steps of ``--tokens-per-batch`` tokens with a metrics row every
``--log-every`` steps (each row's ``tokens_per_s`` is the trainer's figure over its window; the rows of the first
``--skip`` steps, which hold compilation and the graph's capture, are dropped) and reports the median, with the
line the trainer printed about its step (``--compile``), and its ratio to the same row of the committed result
(``--previous``, default ``docs/results/train_default.json``): a row more than 5 % slower is named at the end, so
a regression is seen the day it lands.  Results: ``$OUT/train_default.json`` and a table on stdout.

    python3 benchmarks/train_default.py --out $OUT \\
        --configs "flash-base@2048 flash-base@2048:--compile off transformer-pp-base@2048"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(preset: str, T: int, flags: str, args, work: Path) -> dict:
    name = f"{preset}-{T}-{abs(hash(flags)) % 10**6}"
    cmd = [sys.executable, "-m", "lintime", "train", "--preset", preset, "--context-len", str(T),
           "--tokens-per-batch", str(args.tokens_per_batch), "--steps", str(args.steps), "--log-every",
           str(args.log_every), "--eval-every", "0", "--eval-tokens", str(min(args.tokens_per_batch, 65536)),
           "--save-every", "0", "--sample-tokens", "0", "--no-plots", "--no-progress", "--out", str(work),
           "--name", name, *(["--corpus", args.corpus] if args.corpus else []), *shlex.split(flags)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    with open(Path(args.out) / "train_default.log", "a") as log:  # what the user saw, every run
        log.write(f"$ lintime {' '.join(shlex.quote(c) for c in cmd[3:])}\n{proc.stdout}{proc.stderr}\n")
    row = {"preset": preset, "T": T, "flags": flags or "(default)", "wall_s": round(wall, 1), "rc": proc.returncode,
           "compile_line": next((ln for ln in proc.stdout.splitlines() if "--compile" in ln), "")}
    metrics = work / name / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > args.skip]
    if proc.returncode != 0 or not tps:
        row["error"] = (proc.stderr.strip().splitlines() or ["no metrics"])[-1][:300]
        return row
    row.update(tokens_per_s=round(statistics.median(tps)), tps_min=round(min(tps)), tps_max=round(max(tps)),
               windows=len(tps), final_loss=rows[-1].get("loss") if "loss" in rows[-1] else None)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="space-separated PRESET@T[:FLAGS] (FLAGS with commas for spaces)")
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--corpus", default="")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--previous", default="docs/results/train_default.json",
                   help="the committed result to compare each row with (same preset, T and flags); '' = none")
    args = p.parse_args()
    previous = load_previous(args.previous)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.configs.split():
            head, _, flags = spec.partition(":")
            preset, _, T = head.partition("@")
            row = run_one(preset, int(T), flags.replace(",", " "), args, Path(tmp))
            before = previous["rows"].get((row["preset"], row["T"], row["flags"]))
            if before and row.get("tokens_per_s"):
                row["previous"] = {"commit": previous["commit"], "tokens_per_s": before,
                                   "ratio": round(row["tokens_per_s"] / before, 3)}
            results.append(row)
            print(json.dumps(row), flush=True)
            (out / "train_default.json").write_text(json.dumps(
                {"commit": os.environ.get("LINTIME_GIT_COMMIT", ""), "tokens_per_batch": args.tokens_per_batch,
                 "steps": args.steps, "rows": results}, indent=1))
    print(f"\n{'preset':<22} {'T':>6} {'flags':<36} {'tokens/s':>10} {'vs prev':>8}  step")
    for r in results:
        ratio = f"{r['previous']['ratio']:.3f}" if "previous" in r else "-"
        print(f"{r['preset']:<22} {r['T']:>6} {r['flags']:<36} {r.get('tokens_per_s', 'ERR'):>10} {ratio:>8}  "
              f"{r.get('error') or r['compile_line'][-70:]}")
    slower = [r for r in results if "previous" in r and r["previous"]["ratio"] < 0.95]
    if slower:
        print(f"\nslower than {previous['commit']} by more than 5 %: "
              + ", ".join(f"{r['preset']}@{r['T']} {r['flags']} ({r['previous']['ratio']:.3f})" for r in slower))


def load_previous(path: str) -> dict:
    """``{"commit", "rows": {(preset, T, flags): tokens_per_s}}`` of a committed result (empty when none)."""
    if not path or not Path(path).is_file():
        return {"commit": None, "rows": {}}
    data = json.loads(Path(path).read_text())
    rows = data.get("train_default", data.get("rows", []))
    return {"commit": data.get("commit"), "rows": {(r["preset"], r["T"], r["flags"]): r["tokens_per_s"]
                                                   for r in rows if r.get("tokens_per_s")}}


if __name__ == "__main__":
    main()
