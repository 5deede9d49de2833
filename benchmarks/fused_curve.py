"""Issue #27's training-curve check: the fused path (fused norms, FLASH heads and linear + cross-entropy loss) trains
like the unfused one, within the bf16 rule.

Three ``lintime train`` runs of ``--preset`` (default flash-small) for ``--steps`` (300) on the built-in corpus
(``stdlib``, byte tokenizer, the default batch: 16 rows x 256 tokens), same seed, same data order, same initial
weights: ``fused`` (bf16 autocast, the default path), ``unfused`` (bf16, ``--no-fused``: the ops' chunked PyTorch
forms and the plain loss) and ``reference`` (fp32, unfused: the curve both are measured against).

Rule (tests/tolerances.py's half-precision rule, applied to the curves): the fused curve's distance from the fp32 curve
is at most ``HALF_FACTOR`` (2) times the unfused bf16 curve's distance from it, plus ``HALF_FLOOR[bf16]`` (2^-10)
nats -- over all steps and over the last 50, each distance the mean absolute per-step loss difference.  Two bf16
runs drift apart step by step however they round, so the unfused run's own drift from fp32 is the yardstick; a
per-step equality would fail for any two roundings.

    python3 benchmarks/fused_curve.py --out $OUT [--steps 300] [--preset flash-small] [--device cuda]

Writes ``$OUT/fused_curve.json``: the three curves, the max abs / rel difference fused vs unfused, the distances,
the bound and ``pass``.  About a minute on a warm H100 / H200 (Triton compiles included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tolerance rule, stated once there
from tolerances import HALF_FACTOR, HALF_FLOOR  # noqa: E402

from lintime.training import TrainConfig, train
from lintime.training.metrics import read_metrics

HALF_FLOOR_BF16 = HALF_FLOOR[torch.bfloat16]
TAIL = 50  # steps at the end of the curve compared on their own (where a drift would have accumulated)


def curve(name: str, out: Path, steps: int, preset: str, device: str, precision: str, fused: bool) -> dict:
    cfg = TrainConfig(preset=preset, corpus="stdlib", steps=steps, device=device, precision=precision, fused=fused,
                      seed=0, log_every=1, eval_every=0, save_every=0, keep=1, sample_tokens=0, plots=False)
    t0 = time.perf_counter()
    result = train(cfg, out=out / "runs", name=name, progress=False, echo=None)
    losses = [r["loss"] for r in read_metrics(result.run_dir) if "loss" in r]
    return {"losses": losses, "val_loss": (result.val or {}).get("val_loss"), "wall_s": time.perf_counter() - t0,
            "precision": precision, "fused": fused}


def distance(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / max(len(a), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "fused_curve_out"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="flash-small")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {
        "fused": curve("fused", out, args.steps, args.preset, args.device, "bf16", True),
        "unfused": curve("unfused", out, args.steps, args.preset, args.device, "bf16", False),
        "reference": curve("reference_fp32", out, args.steps, args.preset, args.device, "fp32", False),
    }
    f, u, r = (runs[k]["losses"] for k in ("fused", "unfused", "reference"))
    if not (len(f) == len(u) == len(r) == args.steps):
        raise SystemExit(f"a run stopped early: {len(f)}, {len(u)}, {len(r)} of {args.steps} steps")
    diff = [abs(x - y) for x, y in zip(f, u)]
    checks = {}
    for part, sl in (("all", slice(None)), (f"last_{TAIL}", slice(-TAIL, None))):
        e_fused, e_unfused = distance(f[sl], r[sl]), distance(u[sl], r[sl])
        bound = HALF_FACTOR * e_unfused + HALF_FLOOR_BF16
        checks[part] = {"fused_vs_fp32": e_fused, "unfused_vs_fp32": e_unfused, "bound": bound,
                        "pass": e_fused <= bound}
    result = {
        "preset": args.preset, "steps": args.steps, "device": args.device, "commit": _commit(),
        "rule": f"mean |fused - fp32| <= {HALF_FACTOR:g} x mean |unfused - fp32| + {HALF_FLOOR_BF16:g} "
                f"(per-step training loss, nats; all steps and the last {TAIL})",
        "max_abs_diff_fused_unfused": max(diff),
        "max_rel_diff_fused_unfused": max(d / abs(y) for d, y in zip(diff, u) if y),
        "final_loss": {k: v["losses"][-1] for k, v in runs.items()},
        "checks": checks,
        "pass": all(c["pass"] for c in checks.values()),
        "runs": runs,
    }
    (out / "fused_curve.json").write_text(json.dumps(result, indent=1))
    print(f"{args.preset}, {args.steps} steps: final loss fused {f[-1]:.4f} unfused {u[-1]:.4f} fp32 {r[-1]:.4f}; "
          f"max |fused - unfused| {result['max_abs_diff_fused_unfused']:.4f} "
          f"({100 * result['max_rel_diff_fused_unfused']:.2f} %)")
    for part, c in checks.items():
        print(f"  {part:>8}: |fused - fp32| {c['fused_vs_fp32']:.5f}, |unfused - fp32| {c['unfused_vs_fp32']:.5f}, "
              f"bound {c['bound']:.5f}: {'pass' if c['pass'] else 'FAIL'}")
    print(f"{'PASS' if result['pass'] else 'FAIL'}; wrote {out / 'fused_curve.json'}")
    sys.exit(0 if result["pass"] else 1)


def _commit() -> str | None:
    if os.environ.get("LINTIME_GIT_COMMIT"):
        return os.environ["LINTIME_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
