#!/usr/bin/env python3
"""MQAR recall with Zoology's protocol (issue 43), resumable cell by cell.

Protocol (Zoology, Arora et al. 2023, and its code's multi-point MQAR sweep,
``zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py``; lintime's task code:
``lintime.training.tasks`` trains, ``lintime.evaluation.tasks.mqar`` draws the examples and scores;
nothing here draws an example):

* one model per cell (family, width, learning rate), trained on Zoology's **mixture** of points
  (:data:`MIX` = ``lintime.evaluation.tasks.mqar.ZOOLOGY_MIX``: 64/4 x 100 000 examples, 128/8, 256/16,
  256/32, 256/64 x 20 000 each; vocabulary 8192): every batch holds each point in its proportion
  (252 rows = 140 + 4 x 28, rows padded to 256 tokens, the loss on the queried values only:
  ``lintime train --task mqar --mqar-mix zoology``);
* each model tested at every point of :data:`TEST_POINTS` (the training points and the longer
  512/128, 1024/256), :data:`TEST_EXAMPLES` examples each (Zoology's 1 000);
* 2-layer models of every family at widths 64, 128, 256, 512 (Zoology's blocks: the sequence mixer
  alone, one attention head), Zoology's recipe (AdamW, weight decay 0.1, cosine over 64 epochs of the
  mixture, early stop once the lowest training point passes 0.99: ``TaskTrainConfig``);
* learning rates 2.2e-3, 1e-2, 4.6e-4, 1e-4 (Zoology's grid, tried as a ladder: a rate is skipped once
  a lower rung of the same family and width converged at every training point); the best rate per
  (family, width) is reported (highest lowest-training-point accuracy);
* every cell trained until it converges or its step budget (``--max-steps``, default Zoology's 64
  epochs) or time share (``--cell-seconds``) runs out; its record has each point's accuracy and a
  converged flag per point (accuracy >= 0.99), ``converged`` = every training point, and why it stopped;
* the softmax anchor (Transformer++ with one head) is run first in every rung: the other families'
  numbers at a point are readable only where the anchor converged there (the report says so per point);
* state size: the elements of the decoding state after a prompt of the point's length
  (``lintime.generation.decode.state_nbytes`` / element size), the x axis of Zoology's figure.

Records: ``benchmarks/quality/mqar_runs/<family>-d<width>-lr<rate>.json`` (committed); ``--report``
writes the table and ``docs/results/mqar_state_size.png`` into ``docs/results_recall.md`` between
``<!-- BEGIN mqar-zoology -->`` / ``<!-- END mqar-zoology -->``; ``--list`` shows the plan, each cell's
state and a time estimate (measured seconds per step from finished records of the same width where
there are some, else :data:`ASSUMED_STEP_S`).

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
MIX = ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000))  # ZOOLOGY_MIX
TRAIN_POINTS = tuple((T, n) for T, n, _ in MIX)
TEST_POINTS = TRAIN_POINTS + ((512, 128), (1024, 256))
PLOT_POINTS = ((256, 64), (1024, 256))  # the panels of the figure: the hardest training point, the longest test
WIDTHS = (64, 128, 256, 512)
LRS = (2.2e-3, 1e-2, 4.6e-4, 1e-4)  # Zoology's grid, in the order tried (a cell converged stops the ladder)
ANCHOR = "softmax"
FAMILIES = {  # family -> (tiny preset, n_heads: Zoology's attention has one head)
    "softmax": ("transformer-pp-tiny", 1),
    "flash": ("flash-tiny", None),
    "gla": ("gla-tiny", None),
    "vq": ("vq-tiny", None),
    "linear": ("linear-tiny", None),
}
CONVERGED = 0.99
TEST_EXAMPLES = 1000
EPOCHS = 64
# seconds per training step (H200, CUDA graph, 252 rows x 256 tokens) by width, for --list before any record
# has measured one: an assumption, not a measurement
ASSUMED_STEP_S = {64: 0.004, 128: 0.005, 256: 0.007, 512: 0.012}

# --smoke: two tiny cells on a CPU (vocabulary 32, two short points, one longer test point)
SMOKE_MIX = ((16, 2, 512), (32, 4, 512))
SMOKE_TEST_POINTS = ((16, 2), (32, 4), (64, 8))
SMOKE_VOCAB = 32
SMOKE_STEPS = 64


def points_of(smoke: bool) -> tuple[tuple, tuple, tuple]:
    """(mix, training points, test points) of the plan."""
    mix = SMOKE_MIX if smoke else MIX
    return mix, tuple((T, n) for T, n, _ in mix), SMOKE_TEST_POINTS if smoke else TEST_POINTS


def key(T: int, n: int) -> str:
    return f"{T}/{n}"


@dataclasses.dataclass(frozen=True)
class Cell:
    family: str
    width: int
    lr: float
    rung: int  # position of lr in the ladder

    @property
    def id(self) -> str:
        return f"{self.family}-d{self.width}-lr{self.lr:g}"


def plan(smoke: bool = False) -> list[Cell]:
    """Rung by rung (every cell's first rate before any cell's second), the anchor first in each rung,
    narrow widths first."""
    if smoke:
        return [Cell(f, 64, 3e-3, 0) for f in ("softmax", "gla")]
    return [Cell(fam, d, lr, rung) for rung, lr in enumerate(LRS)
            for fam in sorted(FAMILIES, key=lambda f: f != ANCHOR) for d in WIDTHS]


def read(cell: Cell, runs: Path) -> dict | None:
    try:
        return json.loads((runs / f"{cell.id}.json").read_text())
    except (OSError, ValueError):
        return None


def rank(rec: dict) -> tuple:
    """How good a record is: its lowest training-point accuracy, then its mean test accuracy."""
    train = [rec["tests"][k] for k in rec["train_points"] if rec["tests"].get(k) is not None]
    tests = [v for v in rec["tests"].values() if v is not None]
    return (min(train) if train else -1.0, sum(tests) / len(tests) if tests else -1.0)


def cell_best(cells: list[Cell], runs: Path) -> dict[tuple, dict]:
    """Best record per (family, width) over the rates run."""
    best: dict[tuple, dict] = {}
    for c in cells:
        rec = read(c, runs)
        if not rec or rec.get("status") != "done":
            continue
        k = (c.family, c.width)
        if k not in best or rank(rec) > rank(best[k]):
            best[k] = rec
    return best


def needed(cell: Cell, runs: Path, cells: list[Cell]) -> bool:
    """Not done yet, and no lower rate rung of this (family, width) has converged (the ladder stops there)."""
    if (read(cell, runs) or {}).get("status") == "done":
        return False
    for c in cells:
        if (c.family, c.width) == (cell.family, cell.width) and c.rung < cell.rung:
            rec = read(c, runs)
            if rec and rec.get("status") == "done" and rec.get("converged"):
                return False
    return True


def task_config(cell: Cell, *, device: str, max_steps: int | None, max_seconds: float | None, smoke: bool):
    """The cell's :class:`lintime.training.tasks.TaskTrainConfig`."""
    from lintime.training.tasks import TaskTrainConfig

    preset, heads = FAMILIES[cell.family]
    mix = points_of(smoke)[0]
    return TaskTrainConfig(preset=preset, d_model=cell.width, n_heads=heads, vocab_size=SMOKE_VOCAB if smoke else VOCAB,
                           mix=mix, lr=cell.lr, epochs=16 if smoke else EPOCHS,
                           test_examples=100 if smoke else TEST_EXAMPLES, max_steps=max_steps,
                           max_seconds=(20.0 if smoke else max_seconds), eval_every=(8 if smoke else None),
                           batch_size=(32 if smoke else None), device=device)


def step_seconds(width: int, runs: Path, cells: list[Cell]) -> tuple[float, str]:
    """Seconds per training step at ``width``: measured (the finished records of that width) or assumed."""
    spent = steps = 0.0
    for c in cells:
        rec = read(c, runs)
        if c.width == width and rec and rec.get("status") == "done" and rec.get("steps"):
            spent, steps = spent + rec["train_s"], steps + rec["steps"]
    if steps:
        return spent / steps, "measured"
    return ASSUMED_STEP_S.get(width, 0.012), "assumed"


def state_elements(model, seq_len: int, device) -> int:
    """Elements of the decoding state after a ``seq_len``-token prompt (one sequence)."""
    import torch

    from lintime.generation.decode import state_nbytes

    x = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    with torch.no_grad():
        _, state = model(x, None, return_state=True)
    elem = next(model.parameters()).element_size()
    return state_nbytes(state) // elem


def run_cell(cell: Cell, *, runs: Path, work: Path, device: str, max_steps: int | None, max_seconds: float | None,
             smoke: bool) -> dict:
    import torch

    from lintime.evaluation.tasks.mqar import MQARConfig, evaluate_mqar
    from lintime.training.checkpoint import load_model
    from lintime.training.tasks import train_task

    mix, train_points, test_points = points_of(smoke)
    cfg = task_config(cell, device=device, max_steps=max_steps, max_seconds=max_seconds, smoke=smoke)
    rec: dict = {"id": cell.id, "cell": dataclasses.asdict(cell), "config": cfg.to_dict(), "status": "running",
                 "train_points": [key(T, n) for T, n in train_points], "commit": _commit()}
    t0 = time.time()
    try:
        run_dir = work / cell.id
        if run_dir.exists():  # a run cut off before its record: start it over
            import shutil

            shutil.rmtree(run_dir)
        res = train_task(cfg, out=work, name=cell.id, echo=None, plot=False)
        loaded = load_model(res.run_dir, device=device)
        amp = torch.bfloat16 if device.startswith("cuda") else None
        tests, states = {}, {}
        for (T, n) in test_points:
            r = evaluate_mqar(loaded.model, MQARConfig(vocab_size=cfg.vocab_size, seq_len=T, kv_pairs=n),
                              n_examples=cfg.test_examples, seed=cfg.seed, autocast=amp)
            tests[key(T, n)] = r.accuracy if not r.skipped else None
            if T not in states:
                states[T] = state_elements(loaded.model, T, device)
        point_ok = {k: (v is not None and v >= CONVERGED) for k, v in tests.items()}
        rec.update({"status": "done", "tests": tests, "converged_points": point_ok,
                    "converged": all(point_ok[key(T, n)] for T, n in train_points),
                    "train_accuracy": res.point_accuracy, "lowest_train_accuracy": res.accuracy,
                    "stopped": res.stopped, "steps": res.steps, "epochs": res.epochs, "train_s": res.seconds,
                    "state_elements": {str(T): s for T, s in states.items()},
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


def report(cells: list[Cell], runs: Path, plot: Path | None, smoke: bool = False) -> str:
    mix, train_points, test_points = points_of(smoke)
    best = cell_best(cells, runs)
    cols = [key(T, n) for T, n in test_points]
    train_keys = {key(T, n) for T, n in train_points}
    from lintime.evaluation.tasks.mqar import format_mix

    L = [f"MQAR test accuracy of one model per family and width, trained on Zoology's mixture ({format_mix(mix)}; "
         f"vocabulary {SMOKE_VOCAB if smoke else VOCAB}) and tested at every point ({TEST_EXAMPLES if not smoke else 100} "
         f"examples each; {', '.join(k for k in cols if k not in train_keys)} not trained), at the best rate run "
         "(highest lowest-training-point accuracy); `*` converged there (>= 0.99); `state` = decoding-state "
         "elements after a prompt of the longest training length; `not run`: no record yet.\n"]
    L.append("| family | width | rate | " + " | ".join(cols) + " | state | steps | stopped |")
    L.append("|---|---|---|" + "---|" * len(cols) + "---|---|---|")
    Tmax = str(max(T for T, _ in train_points))
    for fam in FAMILIES if not smoke else sorted({c.family for c in cells}, key=lambda f: f != ANCHOR):
        for d in sorted({c.width for c in cells}):
            rec = best.get((fam, d))
            if rec is None:
                L.append(f"| {fam} | {d} | not run | " + " | ".join("" for _ in cols) + " | | | |")
                continue
            accs = [("n/a" if rec["tests"].get(c) is None else
                     f"{rec['tests'][c]:.3f}{'*' if rec['converged_points'].get(c) else ''}") for c in cols]
            L.append(f"| {fam} | {d} | {rec['cell']['lr']:g} | " + " | ".join(accs)
                     + f" | {rec['state_elements'].get(Tmax, 0):,} | {rec['steps']:,} | {rec['stopped']} |")
    L.append("")
    anchor_ok = {c: any(rec["converged_points"].get(c) for (f, _), rec in best.items() if f == ANCHOR) for c in cols}
    bad = [c for c, ok in anchor_ok.items() if not ok]
    L.append("The softmax anchor converged at every point: every row is readable." if not bad else
             f"The softmax anchor has not converged (at any width) at {', '.join(bad)}: no verdict on any family "
             "at those points.")
    if plot is not None and best:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, len(PLOT_POINTS), figsize=(4.5 * len(PLOT_POINTS), 3.6), sharey=True)
            for ax, (T, n) in zip(axes, PLOT_POINTS):
                for i, fam in enumerate(FAMILIES):
                    pts = sorted((r["state_elements"][str(T)], r["tests"][key(T, n)]) for (f, _), r in best.items()
                                 if f == fam and r["tests"].get(key(T, n)) is not None and str(T) in r["state_elements"])
                    if pts:
                        ax.plot(*zip(*pts), "o-", color=f"C{i}", label=fam)
                ax.set_xscale("log")
                ax.set_ylim(-0.02, 1.02)
                ax.set_title(f"T={T}, {n} pairs{'' if (T, n) in train_points else ' (not trained)'}")
                ax.set_xlabel("state size (elements, one sequence)")
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


def listing(cells: list[Cell], runs: Path, *, max_steps: int | None, cell_seconds: float, smoke: bool) -> str:
    """The plan: each cell, its state, and a time estimate (a full run: the step budget x seconds per step;
    the cap a --budget-s call puts on it: --cell-seconds)."""
    out, total, left = [], 0.0, 0.0
    for c in cells:
        cfg = task_config(c, device="cpu", max_steps=max_steps, max_seconds=None, smoke=smoke)
        per_epoch = cfg.train_examples // cfg.rows
        steps = cfg.epochs * per_epoch if max_steps is None else min(max_steps, cfg.epochs * per_epoch)
        rate, how = step_seconds(c.width, runs, cells)
        est = min(steps * rate, cell_seconds)
        rec = read(c, runs)
        status = (rec or {}).get("status", "not run")
        todo = needed(c, runs, cells)
        if status == "done":
            status += f" (lowest training point {rec['lowest_train_accuracy']:.3f}, {rec['steps']:,} steps" \
                      f"{', converged' if rec['converged'] else ''})"
        elif not todo:
            status = "skipped (a lower rung converged)"
        total += est
        left += est if todo else 0.0
        out.append(f"{c.id:24s} rung {c.rung}  {steps:>6,} steps x {rate * 1e3:.1f} ms ({how}) = "
                   f"{steps * rate / 60:5.1f} min, capped at {est / 60:4.1f} min  {status}")
    out.append(f"{len(cells)} cells (family x width x rate); estimate {total / 3600:.1f} h in all, {left / 3600:.1f} h "
               f"for the cells still needed (each capped at --cell-seconds {cell_seconds:g}; a converged cell stops "
               "early and skips its higher rungs)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--only", default=None, help="comma list of families / widths (d64) / rates (lr0.01) / cell ids")
    ap.add_argument("--max-steps", type=int, default=None, help="step cap per cell (default: Zoology's 64 epochs)")
    ap.add_argument("--cell-seconds", type=float, default=300.0, help="wall-clock cap per cell")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument("--work-dir", type=Path, default=None, help="where the runs train (checkpoints; not committed)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    runs = args.runs_dir or (HERE / "data" / "mqar_smoke_runs" if args.smoke else RUNS)
    cells = plan(args.smoke)
    if args.only:
        keys = set(args.only.split(","))
        cells = [c for c in cells if keys & {c.family, f"d{c.width}", f"lr{c.lr:g}", c.id}]
    if args.list:
        print(listing(cells, runs, max_steps=SMOKE_STEPS if args.smoke else args.max_steps, cell_seconds=args.cell_seconds,
                      smoke=args.smoke))
        return 0
    if args.report:
        block = report(plan(args.smoke), runs, None if args.smoke else PLOT, smoke=args.smoke)
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
    if device == "cpu":  # tiny models: one thread is ~100x faster than two contending ones (lintime train's rule)
        torch.set_num_threads(1)
    deadline = time.monotonic() + args.budget_s
    work = args.work_dir or (HERE / "data" / "mqar_smoke_work" if args.smoke else WORK)
    n = 0
    for c in cells:
        left = deadline - time.monotonic()
        if left < 20:
            break
        if not needed(c, runs, cells):
            continue
        rec = run_cell(c, runs=runs, work=work, device=device, max_steps=args.max_steps if not args.smoke else SMOKE_STEPS,
                       max_seconds=min(args.cell_seconds, left - 15), smoke=args.smoke)
        n += 1
        print(f"mqar: {c.id}: {rec['status']}" + (
            f", lowest training point {rec['lowest_train_accuracy']:.3f} ({rec['stopped']}, {rec['steps']} steps); "
            + ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in rec["tests"].items())
            if rec["status"] == "done" else f": {rec.get('error')}"), flush=True)
    left_cells = sum(needed(c, runs, cells) for c in cells)
    print(f"mqar: {n} cells run; {left_cells} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
