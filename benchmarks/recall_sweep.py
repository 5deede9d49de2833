"""Which architecture recalls: every registered family at small size on MQAR, Zoology's sweep.

For each family (its ``-tiny`` preset; Transformer++ for the softmax family, as Zoology's
attention: :data:`FAMILY_CHANGES`), each
``(seq_len, kv_pairs)`` of Zoology's Figure 2 (64/4, 128/8, 256/16, 512/64) and each model width
(64, 128, 256, 512; 2 layers, vocabulary 8192), train with :func:`lintime.training.tasks.train_task`
(Zoology's recipe: AdamW, weight decay 0.1, cosine over the epochs, early stop at 99 % test
accuracy) at every learning rate of the grid and keep the best test accuracy, as Zoology does.
Writes ``recall_sweep.json`` (every run) and ``recall_sweep.png`` (accuracy against width, one
panel per sequence length, one line per family) into ``--out``.

    python3 benchmarks/recall_sweep.py --out out/recall            # the GPU sweep
    python3 benchmarks/recall_sweep.py --tiny --out /tmp/recall     # seconds on a CPU: a check of the script

A point that cannot be built (a width the family's config refuses) or that fails is recorded
with its error and drawn as missing; it does not stop the sweep.  See docs/results_recall.md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZOOLOGY_POINTS = ((64, 4), (128, 8), (256, 16), (512, 64))  # Figure 2: (seq_len, kv_pairs)
ZOOLOGY_WIDTHS = (64, 128, 256, 512)
ZOOLOGY_LRS = tuple(10 ** (-4 + 2 * i / 3) for i in range(4))  # np.logspace(-4, -2, 4)
# The softmax anchor as Zoology's attention: one head; RoPE alone (the preset's extra absolute
# sinusoids delayed the recall phase change from ~300 to ~1700 steps on a CPU check, 2026-11-27).
FAMILY_CHANGES = {"softmax": {"n_heads": 1, "position": "none"}}


def family_presets() -> dict[str, str]:
    """``{family: its tiny preset}`` over every registered family (Transformer++ for softmax)."""
    from lintime.models import available_families
    from lintime.models.presets import all_presets

    presets = all_presets()
    out = {}
    for fam in available_families():
        tiny = sorted(n for n, c in presets.items() if c.family == fam and n.endswith("-tiny"))
        if fam == "softmax" and "transformer-pp-tiny" in tiny:
            tiny = ["transformer-pp-tiny"]
        if tiny:
            out[fam] = tiny[0]
    return out


def _parse_points(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        T, _, kv = part.partition("/")
        out.append((int(T), int(kv)))
    return out


def run_point(preset: str, width: int, seq_len: int, kv: int, lr: float, args, root: Path, changes: dict) -> dict:
    """One training run (blocks of the mixer alone, 2 layers; ``changes``: more
    :class:`~lintime.training.tasks.TaskTrainConfig` fields); its accuracies, or its error."""
    from lintime.training.tasks import TaskTrainConfig, train_task

    row = {"preset": preset, "d_model": width, "seq_len": seq_len, "kv_pairs": kv, "lr": lr, **changes}
    t0 = time.perf_counter()
    try:
        cfg = TaskTrainConfig(
            **changes, preset=preset, d_model=width, n_layers=2, vocab_size=args.vocab, seq_len=seq_len, kv_pairs=kv,
            train_examples=args.train_examples, test_examples=args.test_examples, epochs=args.epochs, lr=lr,
            max_steps=args.max_steps, seed=args.seed, device=args.device, precision=args.precision,
        )
        res = train_task(cfg, out=root, name=f"{preset}-d{width}-T{seq_len}-kv{kv}-lr{lr:.1e}", echo=None)
        row.update(accuracy=res.accuracy, best_accuracy=res.best_accuracy, steps=res.steps, epochs=res.epochs,
                   train_seconds=round(res.seconds, 2))
    except Exception as err:  # a point that fails is recorded, the sweep goes on
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    row["wall_seconds"] = round(time.perf_counter() - t0, 2)
    return row


def best_by_point(runs: list[dict]) -> list[dict]:
    """One row per (family, width, seq_len, kv_pairs): the learning rate with the best final test
    accuracy (``accuracy`` None when every rate failed)."""
    best: dict[tuple, dict] = {}
    for r in runs:
        key = (r["family"], r["d_model"], r["seq_len"], r["kv_pairs"])
        cur = best.get(key)
        acc = r.get("accuracy")
        if cur is None or (acc is not None and (cur.get("accuracy") is None or acc > cur["accuracy"])):
            best[key] = {"family": r["family"], "preset": r["preset"], "d_model": r["d_model"], "seq_len": r["seq_len"],
                         "kv_pairs": r["kv_pairs"], "accuracy": acc, "lr": r["lr"] if acc is not None else None,
                         "error": r.get("error") if acc is None else None}
    return sorted(best.values(), key=lambda r: (r["seq_len"], r["family"], r["d_model"]))


def plot(best: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["seq_len"] for r in best})
    fig, axes = plt.subplots(1, len(lens), figsize=(4.2 * len(lens), 3.8), dpi=110, squeeze=False)
    for ax, T in zip(axes[0], lens):
        for fam in sorted({r["family"] for r in best}):
            pts = sorted((r["d_model"], r["accuracy"]) for r in best
                         if r["seq_len"] == T and r["family"] == fam and r["accuracy"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=fam)
        kv = next(r["kv_pairs"] for r in best if r["seq_len"] == T)
        ax.set_title(f"seq_len {T}, {kv} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("model width")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy (best learning rate)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(best: list[dict]) -> str:
    """Markdown: one row per family and sequence length, one column per width."""
    widths = sorted({r["d_model"] for r in best})
    lines = ["| family | seq_len / pairs | " + " | ".join(f"d={w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for T in sorted({r["seq_len"] for r in best}):
        for fam in sorted({r["family"] for r in best}):
            cells = {r["d_model"]: r for r in best if r["seq_len"] == T and r["family"] == fam}
            if not cells:
                continue
            kv = next(iter(cells.values()))["kv_pairs"]
            vals = [("failed" if cells[w]["accuracy"] is None else f"{cells[w]['accuracy']:.3f}") if w in cells else ""
                    for w in widths]
            lines.append(f"| {fam} | {T} / {kv} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for recall_sweep.json / .png / .md (and the runs, in runs/)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long CPU check of the script (tiny sizes, one rate)")
    p.add_argument("--families", default="", help="families to run, comma-separated (default: every registered one)")
    p.add_argument("--widths", default=",".join(map(str, ZOOLOGY_WIDTHS)))
    p.add_argument("--points", default=",".join(f"{T}/{kv}" for T, kv in ZOOLOGY_POINTS), help="seq_len/kv_pairs, ...")
    p.add_argument("--lrs", default=",".join(f"{lr:.3g}" for lr in ZOOLOGY_LRS))
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--train-examples", type=int, default=100_000)
    p.add_argument("--test-examples", type=int, default=3_000)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=None, help="cap on the steps of each run (a time budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto")
    p.add_argument("--keep-runs", action="store_true", help="keep every run folder (default: deleted after scoring)")
    args = p.parse_args(argv)
    if args.tiny:
        args.widths, args.points, args.lrs, args.vocab = "16,32", "16/2", "3e-3", 32
        args.train_examples, args.test_examples, args.epochs, args.device = 64, 32, 1, "cpu"

    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    presets = family_presets()
    if args.families:
        wanted = [f.strip() for f in args.families.split(",")]
        unknown = [f for f in wanted if f not in presets]
        if unknown:
            p.error(f"unknown families {unknown}; registered: {sorted(presets)}")
        presets = {f: presets[f] for f in wanted}
    widths = [int(w) for w in args.widths.split(",")]
    points = _parse_points(args.points)
    lrs = [float(x) for x in args.lrs.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = out / "runs" if args.keep_runs else Path(tempfile.mkdtemp(prefix="recall-runs-"))
    runs = []
    t0 = time.perf_counter()
    total = len(presets) * len(widths) * len(points) * len(lrs)
    for fam, preset in presets.items():
        for T, kv in points:
            for w in widths:
                for lr in lrs:
                    row = {"family": fam, **run_point(preset, w, T, kv, lr, args, root, FAMILY_CHANGES.get(fam, {}))}
                    runs.append(row)
                    acc = row.get("accuracy")
                    print(f"[{len(runs)}/{total}] {fam:>10} d={w:<4} T={T:<4} kv={kv:<3} lr={lr:.1e}: "
                          + (f"accuracy {acc:.3f} ({row['steps']} steps, {row['wall_seconds']:.0f} s)" if acc is not None
                             else row["error"]), flush=True)
    if not args.keep_runs:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    best = best_by_point(runs)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else platform.processor() or "cpu"
    result = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "device": device, "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "seconds": round(time.perf_counter() - t0, 1), "best": best, "runs": runs,
    }
    (out / "recall_sweep.json").write_text(json.dumps(result, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)) + "\n")
    (out / "recall_sweep.md").write_text(table(best) + "\n")
    plot(best, out / "recall_sweep.png")
    print(table(best))
    print(f"wrote {out / 'recall_sweep.json'}, recall_sweep.md and recall_sweep.png ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
