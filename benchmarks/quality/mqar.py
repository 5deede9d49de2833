#!/usr/bin/env python3
"""MQAR recall with Zoology's protocol (issue 43), resumable cell by cell.

Protocol (Zoology, Arora et al. 2023; lintime's task code: ``lintime.training.tasks`` trains,
``lintime.evaluation.tasks.mqar`` draws the examples and scores; nothing here draws an example):

* vocabulary 8192; training points (sequence length / key-value pairs) up to 256 / 64:
  64/4, 128/8, 256/16, 256/64 (:data:`TRAIN_POINTS`); each trained model is also tested on the
  longer points up to 1024 / 256 (:data:`TEST_POINTS`: 512/128, 1024/256);
* 2-layer models of every family at widths 64, 128, 256, 512 (Zoology's blocks: the sequence mixer
  alone, one attention head), Zoology's recipe (AdamW, weight decay 0.1, cosine over 64 epochs of
  100 000 examples, early stop above 0.99: ``lintime.training.tasks.TaskTrainConfig``);
* learning rates 1e-4, 4.6e-4, 2.2e-3, 1e-2 (Zoology's grid), the best kept per cell;
* every cell trained until its test accuracy passes 0.99 or its step budget (``--max-steps``, default
  Zoology's whole 64 epochs) or time share runs out: the record says ``converged`` (> 0.99) or not, and
  why it stopped;
* the softmax anchor (Transformer++ with one head) is run first at every point: the other families'
  numbers at a point are readable only where the anchor converged there (the page says so);
* state size: the elements of the decoding state after a full-length test prompt
  (``lintime.generation.decode.state_nbytes`` / element size), the x axis of Zoology's figure.

Records: ``benchmarks/quality/mqar_runs/<family>-d<width>-T<len>-n<pairs>-lr<rate>.json`` (committed);
``--report`` writes the table and ``docs/results/mqar_state_size.png`` into ``docs/results_recall.md``
between ``<!-- BEGIN mqar-zoology -->`` / ``<!-- END mqar-zoology -->``.

Usage::

    python3 benchmarks/quality/mqar.py --list
    python3 benchmarks/quality/mqar.py --budget-s 540 [--only softmax] [--max-steps N]
    python3 benchmarks/quality/mqar.py --report
    python3 benchmarks/quality/mqar.py --smoke          # two tiny cells on a CPU in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
RUNS = HERE / "mqar_runs"
WORK = HERE / "data" / "mqar_work"
PAGE = REPO / "docs" / "results_recall.md"
PLOT = REPO / "docs" / "results" / "mqar_state_size.png"
BEGIN, END = "<!-- BEGIN mqar-zoology -->", "<!-- END mqar-zoology -->"

VOCAB = 8192
TRAIN_POINTS = ((64, 4), (128, 8), (256, 16), (256, 64))
TEST_POINTS = ((512, 128), (1024, 256))
WIDTHS = (64, 128, 256, 512)
LRS = (2.2e-3, 1e-2, 4.6e-4, 1e-4)  # Zoology's grid, in the order tried (a cell above 0.99 stops the ladder)
ANCHOR = "softmax"
FAMILIES = {  # family -> (tiny preset, n_heads: Zoology's attention has one head)
    "softmax": ("transformer-pp-tiny", 1),
    "flash": ("flash-tiny", None),
    "gla": ("gla-tiny", None),
    "vq": ("vq-tiny", None),
    "linear": ("linear-tiny", None),
}
CONVERGED = 0.99
TEST_EXAMPLES = 3000


@dataclasses.dataclass(frozen=True)
class Cell:
    family: str
    width: int
    seq_len: int
    kv_pairs: int
    lr: float
    rung: int  # position of lr in the ladder

    @property
    def id(self) -> str:
        return f"{self.family}-d{self.width}-T{self.seq_len}-n{self.kv_pairs}-lr{self.lr:g}"

    @property
    def point(self) -> str:
        return f"{self.seq_len}/{self.kv_pairs}"


def plan(smoke: bool = False) -> list[Cell]:
    """Rung by rung (every cell's first rate before any cell's second), the anchor first in each rung,
    narrow widths and short points first."""
    if smoke:
        return [Cell(f, 64, 64, 4, 1e-2, 0) for f in ("softmax", "gla")]
    out = []
    for rung, lr in enumerate(LRS):
        for fam in sorted(FAMILIES, key=lambda f: f != ANCHOR):
            for (T, n) in TRAIN_POINTS:
                for d in WIDTHS:
                    out.append(Cell(fam, d, T, n, lr, rung))
    return out


def read(cell: Cell, runs: Path) -> dict | None:
    try:
        return json.loads((runs / f"{cell.id}.json").read_text())
    except (OSError, ValueError):
        return None


def cell_best(cells: list[Cell], runs: Path) -> dict[tuple, dict]:
    """Best record per (family, width, point) over the rates run."""
    best: dict[tuple, dict] = {}
    for c in cells:
        rec = read(c, runs)
        if not rec or rec.get("status") != "done":
            continue
        key = (c.family, c.width, c.seq_len, c.kv_pairs)
        if key not in best or rec["accuracy"] > best[key]["accuracy"]:
            best[key] = rec
    return best


def needed(cell: Cell, runs: Path, cells: list[Cell]) -> bool:
    """Not done yet, and no other rate of this cell has converged (the ladder stops there)."""
    if (read(cell, runs) or {}).get("status") == "done":
        return False
    for c in cells:
        if (c.family, c.width, c.seq_len, c.kv_pairs) == (cell.family, cell.width, cell.seq_len, cell.kv_pairs) \
                and c.rung < cell.rung:
            rec = read(c, runs)
            if rec and rec.get("status") == "done" and rec.get("converged"):
                return False
    return True


def state_elements(model, seq_len: int, device) -> int:
    """Elements of the decoding state after a ``seq_len``-token prompt (one sequence)."""
    import torch

    from lintime.generation.decode import state_nbytes

    x = torch.randint(0, 64, (1, seq_len), device=device)
    with torch.no_grad():
        _, state = model(x, None, return_state=True)
    elem = next(model.parameters()).element_size()
    return state_nbytes(state) // elem


def run_cell(cell: Cell, *, runs: Path, work: Path, device: str, max_steps: int | None, max_seconds: float | None,
             smoke: bool) -> dict:
    import torch

    from lintime.evaluation.tasks.mqar import MQARConfig, evaluate_mqar
    from lintime.training.checkpoint import load_model
    from lintime.training.tasks import TaskTrainConfig, train_task

    preset, heads = FAMILIES[cell.family]
    cfg = TaskTrainConfig(preset=preset, d_model=cell.width, n_heads=heads, vocab_size=64 if smoke else VOCAB,
                          seq_len=cell.seq_len, kv_pairs=cell.kv_pairs, lr=cell.lr,
                          train_examples=512 if smoke else 100_000, test_examples=100 if smoke else TEST_EXAMPLES,
                          max_steps=max_steps, max_seconds=(20.0 if smoke else max_seconds),
                          eval_every=(4 if smoke else None), batch_size=(32 if smoke else None),
                          device=device)
    rec: dict = {"id": cell.id, "cell": dataclasses.asdict(cell), "config": cfg.to_dict(), "status": "running",
                 "commit": _commit()}
    t0 = time.time()
    try:
        res = train_task(cfg, out=work, name=cell.id, echo=None, plot=False)
        loaded = load_model(res.run_dir, device=device)
        amp = torch.bfloat16 if device.startswith("cuda") else None
        tests = {}
        for (T, n) in ((cell.seq_len, cell.kv_pairs),) + (() if smoke else TEST_POINTS):
            r = evaluate_mqar(loaded.model, MQARConfig(vocab_size=cfg.vocab_size, seq_len=T, kv_pairs=n),
                              n_examples=cfg.test_examples, autocast=amp)
            tests[f"{T}/{n}"] = r.accuracy if not r.skipped else None
        rec.update({"status": "done", "accuracy": res.best_accuracy, "last_accuracy": res.accuracy,
                    "converged": res.best_accuracy > CONVERGED, "stopped": res.stopped, "steps": res.steps,
                    "epochs": res.epochs, "train_s": res.seconds, "tests": tests,
                    "state_elements": state_elements(loaded.model, cell.seq_len, device),
                    "n_params": loaded.model.num_parameters()})
    except Exception as err:  # noqa: BLE001 - one cell's failure is recorded, the sweep goes on
        rec.update({"status": "failed", "error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"})
    rec["wall_s"] = time.time() - t0
    runs.mkdir(parents=True, exist_ok=True)
    (runs / f"{cell.id}.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def _commit() -> str | None:
    import subprocess

    if os.environ.get("LINTIME_GIT_COMMIT"):
        return os.environ["LINTIME_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def report(cells: list[Cell], runs: Path, plot: Path | None) -> str:
    best = cell_best(cells, runs)
    L = ["MQAR test accuracy at the best rate run (vocabulary 8192; trained at the row's point, also tested at "
         "512/128 and 1024/256 in the JSON); `*` converged (> 0.99), `not run`: no record yet.\n"]
    anchor_ok = {}
    for (T, n) in TRAIN_POINTS:
        accs = [best[(ANCHOR, d, T, n)]["accuracy"] for d in WIDTHS if (ANCHOR, d, T, n) in best]
        anchor_ok[(T, n)] = any(a > CONVERGED for a in accs)
    L.append("| family | point | " + " | ".join(f"d={d}" for d in WIDTHS) + " |")
    L.append("|---|---|" + "---|" * len(WIDTHS))
    for fam in FAMILIES:
        for (T, n) in TRAIN_POINTS:
            row = []
            for d in WIDTHS:
                rec = best.get((fam, d, T, n))
                row.append("not run" if rec is None else f"{rec['accuracy']:.3f}{'*' if rec['converged'] else ''}")
            L.append(f"| {fam} | {T}/{n} | " + " | ".join(row) + " |")
    L.append("")
    bad = [f"{T}/{n}" for (T, n), ok in anchor_ok.items() if not ok]
    L.append("The softmax anchor converged at every point: the other rows are readable." if not bad else
             f"The softmax anchor has not converged at {', '.join(bad)}: no verdict on any family at those points.")
    if plot is not None and best:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, len(TRAIN_POINTS), figsize=(4 * len(TRAIN_POINTS), 3.5), sharey=True)
            for ax, (T, n) in zip(axes, TRAIN_POINTS):
                for i, fam in enumerate(FAMILIES):
                    pts = sorted((best[(fam, d, T, n)]["state_elements"], best[(fam, d, T, n)]["accuracy"])
                                 for d in WIDTHS if (fam, d, T, n) in best)
                    if pts:
                        ax.plot(*zip(*pts), "o-", color=f"C{i}", label=fam)
                ax.set_xscale("log")
                ax.set_title(f"T={T}, {n} pairs")
                ax.set_xlabel("state size (elements)")
                ax.grid(alpha=0.3)
            axes[0].set_ylabel("MQAR accuracy")
            axes[0].legend()
            fig.tight_layout()
            plot.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(plot, dpi=110)
            plt.close(fig)
            L.append(f"\n![{plot.name}](results/{plot.name})")
        except ImportError:
            L.append("\n(plot skipped: matplotlib is not installed)")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--only", default=None, help="comma list of families / points (T/n) / widths (d64)")
    ap.add_argument("--max-steps", type=int, default=None, help="step cap per cell (default: Zoology's 64 epochs)")
    ap.add_argument("--cell-seconds", type=float, default=120.0, help="wall-clock cap per cell")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    runs = args.runs_dir or (HERE / "data" / "mqar_smoke_runs" if args.smoke else RUNS)
    cells = plan(args.smoke)
    if args.only:
        keys = set(args.only.split(","))
        cells = [c for c in cells if keys & {c.family, c.point, f"d{c.width}"}]
    if args.list:
        for c in cells:
            rec = read(c, runs)
            print(f"{c.id:40s} rung {c.rung}  {(rec or {}).get('status', 'not run')}"
                  + (f" acc {rec['accuracy']:.3f}" if rec and rec.get("status") == "done" else ""))
        print(f"{len(cells)} cells x rates")
        return 0
    if args.report:
        block = report(plan(args.smoke), runs, None if args.smoke else PLOT)
        if args.smoke:
            print(block)
            return 0
        text = PAGE.read_text()
        if BEGIN in text and END in text:
            text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + block + text[text.index(END):]
        else:
            text = text.rstrip() + f"\n\n{BEGIN}\n{block}{END}\n"
        PAGE.write_text(text)
        print(f"mqar: {PAGE} updated")
        return 0
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    deadline = time.monotonic() + args.budget_s
    n = 0
    for c in cells:
        left = deadline - time.monotonic()
        if left < 20:
            break
        if not needed(c, runs, cells):
            continue
        rec = run_cell(c, runs=runs, work=WORK, device=device, max_steps=args.max_steps if not args.smoke else 8,
                       max_seconds=min(args.cell_seconds, left - 15), smoke=args.smoke)
        n += 1
        print(f"mqar: {c.id}: {rec['status']}" + (f", accuracy {rec['accuracy']:.3f} ({rec['stopped']}, "
              f"{rec['steps']} steps, state {rec['state_elements']:,})" if rec["status"] == "done" else
              f": {rec.get('error')}"), flush=True)
    left_cells = sum(needed(c, runs, cells) for c in cells)
    print(f"mqar: {n} cells run; {left_cells} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
