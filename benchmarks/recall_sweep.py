"""Which architecture recalls: every registered family at small size on MQAR, Zoology's sweep.

The grid: each family (its ``-tiny`` preset; Transformer++ for the softmax family, as Zoology's
attention: :data:`FAMILY_CHANGES`) x each ``(seq_len, kv_pairs)`` of Zoology's Figure 2 (64/4,
128/8, 256/16, 512/64) x each model width (64, 128, 256, 512; 2 layers, vocabulary 8192), trained
with :func:`lintime.training.tasks.train_task` (Zoology's recipe: AdamW, weight decay 0.1, a
cosine to 0 over 64 epochs, stop above 99 % test accuracy; 100 000 train / 3 000 test examples),
cut short as below.  Writes ``recall_sweep.json`` (every run and every cell), ``recall_sweep.md`` (the table)
and ``recall_sweep.png`` (accuracy against width, one panel per length, one line per family).

Time-boxed for one GPU (issue 31: the sweep in <= 10 minutes; Zoology trains 64 epochs of
100 000 examples per run, 12 500-50 000 steps, at four rates -- weeks of GPU time for this grid):

* each run is the start of Zoology's: ``--steps`` steps (default 1000) of ``--rows`` examples (64;
  Zoology: 512 at T <= 128, 256, 128 at 512), Zoology's 64-epoch cosine cut there (so near the peak
  rate throughout), the test accuracy every ``--eval-every`` steps (200; stop above 0.99).  Why
  64 rows: the recall phase change comes after a number of *steps* more than of examples (CPU
  checks of the anchor, width 64, T = 64, 4 pairs, 2026-11-27: 64 rows passed 0.99 by step 600;
  512 rows with a cosine over 600 steps stalled at 24 %), and a 64-row step costs the GPU ~1/4 to
  1/8 of a Zoology step; the anchor's runs have ``--anchor-steps`` (4000): the anchor checks that
  the setup can solve the task at all (attention does, in Zoology), so it gets the budget to show
  it, and stops early once it has;
* the learning rates are a ladder (``--lrs``, Zoology's four, most useful first): every cell runs
  at the first rate; a cell still at or below 0.99 gets the next rate once every cell had its
  first (Zoology runs all four and keeps the best; a cell above 0.99 could gain < 1 %);
* rung by rung, the anchor (the softmax family) first, then narrow widths first (the cheap cells),
  then short sequences, the families interleaved, so that a sweep cut by the deadline still has
  every family at the same cells;
* each step is one CUDA graph replay (:class:`lintime.training.tasks.TaskRun`): eagerly, a
  2-layer model's step is 300-700 operator calls (CPU profile of every family at width 64,
  2026-11-27), each a kernel of a few microseconds on the GPU, so its launches set its time (the
  last eager sweep, 8 processes on an H200: ~30 ms per step per process, ~300 steps/s in all);
* ``--jobs`` worker processes (10 on CUDA: :data:`CUDA_JOBS`) of one run each: the kernels of
  separate processes take turns on the GPU, and the other processes keep it busy while one builds
  a run, compiles its Triton kernels (the largest host cost on a fresh machine; Triton's cache,
  ``~/.triton/cache`` or ``TRITON_CACHE_DIR``, is shared by the workers and kept for a later
  sweep: ``--smoke`` fills it for widths 64 and 512), captures its graph or evaluates it.
  (Four processes of four runs each on their own CUDA streams were tried on an H200, 2026-11-27: a process's
  runs took their first steps -- build, compiles, warm-up, capture -- one after the other while every run's
  clock ran, 9-11 steps per run in ~117 s; one run per process is the design since);
* a worker whose run meets a CUDA error or whose step does not capture exits (its process is not
  trusted with another run); a fresh one trains that run again with the plain eager loop (the
  record keeps the first try's error as ``first_try``), and the later runs of that family and
  width go eager from the start.  A run whose captured step diverges is tried once more eagerly
  too (a vq run went to NaN by step 9 in the graph on the H200, in the process where gla's
  capture had failed just before); if the eager one does not diverge, that family and width go
  eager from then on.  The training examples of each (seq_len, kv_pairs) are drawn
  once per process and shared by its runs (a 64-row batch costs the host 0.9 ms to draw at
  T = 64, 6.9 ms at T = 512 on a 2-core CPU: more than a graph step);
* time: at ``--deadline-s`` (480) the runs in flight stop and are scored where they are
  (``stopped: max_seconds``, marked in the table); runs not started are recorded as ``not run
  (deadline)``; and each run's training after its first step (build, compiles and capture not
  counted) is capped at its share of the workers' time to the deadline, in proportion to its step
  budget (:func:`time_shares`: 10 workers x (480 - 20) s less 5 s a run, over 128 runs + 16
  anchor runs x 4 = 20 s a run, 81 s an anchor run), so that a slow step form still gives every cell its first
  rung.  Why 480 s and these budgets: the first rung is 192 000 steps (128 runs x 1000 + 16 anchor
  runs x 4000), 640 s at the eager sweep's ~300 steps/s -- over the deadline, hence the shares --
  and ~200-400 s at ~1-2 ms a graph step (estimated from the kernel counts above, not yet
  measured), less with the early stops; start-up, the last evaluations and the report keep the
  whole command under 8.5 minutes.  Every run's record says its step form, steps, seconds (setup,
  first step, evaluations, training) and the sweep prints one summary line (finished / killed /
  failed, steps per second over the sweep), also in the JSON's ``summary``.

    python3 benchmarks/recall_sweep.py --smoke --out out/smoke                 # ~1 min GPU check; exit 1: unhealthy
    python3 benchmarks/recall_sweep.py --out out/recall                        # the GPU sweep (~8.5 min)
    python3 benchmarks/recall_sweep.py --tiny --out /tmp/recall                # seconds on a CPU
    python3 benchmarks/recall_sweep.py --report out/recall/recall_sweep.json \\
        --passkey out/passkey/passkey_sweep.json                               # docs/results_recall.md

A run that fails (a width a config refuses, a divergence) is recorded with its error; a diverged
run moves its cell to the next rate; nothing stops the sweep.  See docs/results_recall.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ZOOLOGY_POINTS = ((64, 4), (128, 8), (256, 16), (512, 64))  # Figure 2: (seq_len, kv_pairs)
ZOOLOGY_WIDTHS = (64, 128, 256, 512)
# Zoology's grid np.logspace(-4, -2, 4), as a ladder: the rate most likely to solve a cell in a
# short run first, then the high one (small widths), then the low ones
ZOOLOGY_LRS = (2.2e-3, 1e-2, 4.6e-4, 1e-4)
TARGET = 0.99  # Zoology's early stop; a cell above it is solved
ANCHOR = "softmax"  # attention solves MQAR: the sanity anchor, scheduled first
# The softmax anchor as Zoology's attention: one head; RoPE alone (the preset's extra absolute
# sinusoids delayed the recall phase change from ~300 to ~1700 steps on a CPU check, 2026-11-27).
FAMILY_CHANGES = {"softmax": {"n_heads": 1, "position": "none"}}
# the GPU's workers, processes of one run each: 10, more than the 8 that kept the GPU busy eagerly, so that
# builds, compiles and evaluations of some overlap the steps of others (16 host CPUs per GPU); H200, 2026-11-27:
# 204 runs, ~500 graph steps/s over the ten
CUDA_JOBS = 10
# what a run's time share keeps back of the deadline: the workers' start (importing torch and
# initialising CUDA in 10 processes at once) and the last evaluations (a guess; the H200 sweep of 2026-11-27 ended
# 8 s before its deadline with this reserve)
SHARE_RESERVE_S = 20.0
# a run's seconds outside its share: the build and the first step (warm-up, capture; Triton's
# compiles when its cache is cold): H200, 2026-11-27, 203 runs: build median 0.34 s (max 6.4), first step
# median 0.36 s (max 7.7; the cold compiles), so 5 s covers a run but a family's first one
RUN_OVERHEAD_S = 5.0
NOT_RUN = "not run (deadline)"
KILLED = "killed at the deadline"


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


# ---------------------------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the grid: a family's preset at a width, on one MQAR setting."""

    family: str
    preset: str
    d_model: int
    seq_len: int
    kv_pairs: int

    @property
    def key(self) -> tuple:
        return (self.family, self.d_model, self.seq_len, self.kv_pairs)


@dataclasses.dataclass(frozen=True)
class Task:
    """One run: a cell at rung ``rung`` of the learning-rate ladder."""

    cell: Cell
    rung: int
    lr: float


class Ladder:
    """The order of the runs.  Every cell starts at rung 0 (the first rate); :meth:`done` with a
    result at or below ``target`` (or a divergence) queues the cell's next rate.  :meth:`next`
    gives the pending run of highest priority: the lowest rung, then the anchor family, then the
    cells' given order (so an anchor that cannot solve a cell does not hold back the others' first
    rate with its next ones)."""

    def __init__(self, cells: list[Cell], lrs: list[float], *, target: float = TARGET, first: str = ANCHOR):
        self.lrs, self.target, self.first = list(lrs), target, first
        self.order = {c.key: i for i, c in enumerate(cells)}
        self.best: dict[tuple, float | None] = {c.key: None for c in cells}
        self._heap: list[tuple] = []
        for c in cells:
            self._push(c, 0)

    def _push(self, cell: Cell, rung: int) -> None:
        prio = (rung, cell.family != self.first, self.order[cell.key])
        heapq.heappush(self._heap, (prio, Task(cell, rung, self.lrs[rung])))

    def next(self) -> Task | None:
        return heapq.heappop(self._heap)[1] if self._heap else None

    def done(self, task: Task, accuracy: float | None, *, retry: bool = True) -> None:
        """Record a finished run (``accuracy`` None: it failed); ``retry``: whether a cell left
        below the target may take the next rate (no for a run cut by the deadline or one that
        could not be built)."""
        key = task.cell.key
        if accuracy is not None and (self.best[key] is None or accuracy > self.best[key]):
            self.best[key] = accuracy
        solved = self.best[key] is not None and self.best[key] > self.target
        if retry and not solved and task.rung + 1 < len(self.lrs):
            self._push(task.cell, task.rung + 1)

    def pending(self) -> list[Task]:
        return [t for _, t in sorted(self._heap)]


def make_cells(presets: dict[str, str], points, widths) -> list[Cell]:
    """The grid in its run order: narrow widths first (a width-512 step costs ~8x a width-64 one),
    then short sequences, the families innermost."""
    return [Cell(fam, preset, w, T, kv) for w in widths for T, kv in points for fam, preset in presets.items()]


# ---------------------------------------------------------------------------------------------- one run


@dataclasses.dataclass
class Live:
    """A run being trained: its :class:`~lintime.training.tasks.TaskRun` (None when it could not be
    built), its record so far, its folder name and start time."""

    run: object
    row: dict
    name: str
    t0: float


def open_run(task: Task, settings: dict, root: str, max_seconds: float | None, data: dict, *,
             graph: str | None = None, fallback: bool = True) -> Live:
    """Build the run of ``task``; ``data`` holds one :class:`~lintime.training.tasks.MQARData` per
    setting, shared by the runs of this process (made on first use); ``graph`` overrides the
    settings' step form, ``fallback`` is :class:`~lintime.training.tasks.TaskRun`'s."""
    from lintime.training.tasks import MQARData, TaskRun, TaskTrainConfig
    from lintime.utils.device import pick_device

    c = task.cell
    changes = FAMILY_CHANGES.get(c.family, {})
    row = {**_task_row(task), **changes}
    t0 = time.perf_counter()
    name = f"{c.preset}-d{c.d_model}-T{c.seq_len}-kv{c.kv_pairs}-lr{task.lr:.1e}"
    steps = settings["anchor_steps"] if c.family == ANCHOR and settings.get("anchor_steps") else settings["steps"]
    row["budget"] = steps
    try:
        cfg = TaskTrainConfig(
            **changes, preset=c.preset, d_model=c.d_model, n_layers=2, vocab_size=settings["vocab"], seq_len=c.seq_len,
            kv_pairs=c.kv_pairs, train_examples=settings["train_examples"], test_examples=settings["test_examples"],
            batch_size=settings.get("rows"),
            epochs=settings["epochs"], lr=task.lr, max_steps=steps, eval_every=settings["eval_every"],
            max_seconds=max_seconds, seed=settings["seed"], device=settings["device"], precision=settings["precision"],
            graph=graph or settings.get("graph", "auto"),
        )
        device = pick_device(cfg.device)
        key = MQARData.key_of(cfg, device)
        if key not in data:
            data[key] = MQARData(cfg.mqar, seed=cfg.seed, train_examples=cfg.train_examples,
                                 test_examples=cfg.test_examples, device=device)
        run = TaskRun(cfg, out=root, name=name, echo=None, plot=False, data=data[key], fallback=fallback)
    except Exception as err:  # a run that cannot be built is recorded, the sweep goes on
        live = Live(None, row, name, t0)
        return close_run(live, settings, root, err)
    return Live(run, row, name, t0)


def close_run(live: Live, settings: dict, root: str, err: BaseException | None = None) -> Live:
    """Score the finished run into its record (or record ``err``, the exception that ended it) and
    delete its folder unless the runs are kept."""
    row, run = live.row, live.run
    try:
        if err is None and run is not None:
            res = run.finish()
            row.update(accuracy=res.accuracy, best_accuracy=res.best_accuracy, steps=res.steps, stopped=res.stopped,
                       train_seconds=round(res.seconds, 2))
        elif err is not None:
            row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
            row["diverged"] = "diverged" in str(err)
        if run is not None:
            row["step"] = run.form
            row.setdefault("steps", run.step)
            row.update(run.timing)
    except Exception as e:  # saving failed: recorded as the run's error
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        if not settings.get("keep_runs"):
            shutil.rmtree(Path(root) / live.name, ignore_errors=True)
    row["wall_seconds"] = round(time.perf_counter() - live.t0, 2)
    live.run = None  # the model, its graph and its memory go with it
    return live


def run_task(task: Task, settings: dict, root: str, max_seconds: float | None = None,
             data: dict | None = None) -> dict:
    """Train one run to its end; its record (accuracies, steps, why it stopped), or its error."""
    live = open_run(task, settings, root, max_seconds, {} if data is None else data)
    if live.run is not None:
        err = None
        try:
            while not live.run.advance():
                pass
        except Exception as e:  # a run that fails is recorded, the sweep goes on
            err = e
        close_run(live, settings, root, err)
    return live.row


def _poisoned(row: dict) -> bool:
    """Whether a run's error may have poisoned its process (a CUDA error, out of memory, a capture
    that failed: its process is not trusted with another run)."""
    return any(s in row.get("error", "") for s in ("CUDA", "cuda", "out of memory", "illegal", "CaptureFailed",
                                                     "capture"))


def _worker(conn, settings: dict, root: str) -> None:
    """A worker process: trains one run at a time.  Takes ``(id, task, stop_at, share, graph)`` messages
    (``stop_at``: the deadline as a ``time.time()``; ``share``: the run's seconds counted from the end of its first
    step -- build, compiles and capture not counted -- or None; ``graph``: the step form, None = the settings'),
    sends ``(id, record, leave)`` as each run ends; stops at ``None``.  ``leave``: a CUDA error or a failed capture
    may have poisoned the process, which then exits (the parent starts a new one and retries the run eagerly)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    import lintime.training.tasks  # noqa: F401  (imported while the parent sends the first task)

    torch.set_num_threads(1)
    if torch.cuda.is_available() and not str(settings["device"]).startswith("cpu"):
        torch.cuda.init()
    data: dict = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        tid, task, stop_at, share, graph = msg
        lv = open_run(task, settings, root, max(stop_at - time.time(), 1e-3), data, graph=graph, fallback=False)
        if lv.run is not None:
            err = None
            try:
                done = lv.run.advance(1)  # the first step alone: the share counts from its end
                if share is not None:
                    lv.run.limit(share)
                while not done:
                    done = lv.run.advance()
            except Exception as e:  # a diverged or failed run is recorded, the sweep goes on
                err = e
            close_run(lv, settings, root, err)
        leave = _poisoned(lv.row)
        conn.send((tid, lv.row, leave))
        if leave:
            return


# ---------------------------------------------------------------------------------------------- the sweep


def _retry(row: dict) -> bool:
    if "error" in row:
        return bool(row.get("diverged"))
    return row.get("stopped") != "max_seconds"


def sweep_in_process(ladder: Ladder, runner: Callable[[Task, float], dict], deadline: float, *,
                     min_run_s: float = 0.0, say=print, clock=time.monotonic) -> list[dict]:
    """Run the ladder's tasks one after the other with ``runner(task, max_seconds)`` until it is
    empty or ``deadline`` (a ``clock`` time) is near; returns the finished runs' records."""
    runs: list[dict] = []
    while True:
        left = deadline - clock()
        if left <= min_run_s:
            break
        task = ladder.next()
        if task is None:
            break
        row = runner(task, left)
        runs.append(row)
        ladder.done(task, row.get("accuracy"), retry=_retry(row))
        say(_progress(row, len(runs)))
    return runs


class RetryBook:
    """Which runs are tried again with the plain eager loop, and which (family, width) go eager
    from the start (see :func:`sweep_pool`)."""

    def __init__(self):
        self.eager: set[Task] = set()  # runs retried eagerly (once each)
        self.no_capture: set[tuple] = set()  # (family, width) whose graph step failed
        self.first: dict[Task, str] = {}  # a retried run's first error

    def plain(self, task: Task) -> bool:
        """Whether ``task`` is sent with ``graph="off"``."""
        return task in self.eager or (task.cell.family, task.cell.d_model) in self.no_capture

    def after(self, task: Task, row: dict, leave: bool) -> bool:
        """Note a finished run (``leave``: its worker left); True: try it again eagerly."""
        fw = (task.cell.family, task.cell.d_model)
        captured_nan = bool(row.get("diverged")) and row.get("step") == "capture"
        if (leave or captured_nan) and task not in self.eager:
            self.eager.add(task)
            self.first[task] = row.get("error", "?")
            if "CaptureFailed" in self.first[task]:
                self.no_capture.add(fw)
            return True
        if "diverged" in self.first.get(task, "") and "accuracy" in row:  # the graph's NaN, not the rate's
            self.no_capture.add(fw)
        elif row.get("step") == "off" and fw in self.no_capture and task not in self.eager:
            row["step"] = "off (its family's graph step failed at this width)"
        return False

    def first_try(self, task: Task) -> str | None:
        return self.first.pop(task, None)


def sweep_pool(ladder: Ladder, settings: dict, root: str, jobs: int, deadline: float, *, min_run_s: float,
               grace_s: float, say=print, share: Callable[[Task], float | None] | None = None
               ) -> list[dict]:
    """Run the ladder's tasks on ``jobs`` worker processes (spawned: CUDA in each) of one run at a
    time until it is empty or the deadline; the workers' runs stop themselves at the
    deadline (and after ``share(task)`` seconds of training, when given), a worker with a run
    still going ``grace_s`` after it is killed.  A worker that leaves (a CUDA error, a failed
    capture) is replaced by a fresh process, and its run is tried once more there with the plain
    eager loop (``graph="off"``) unless it ran that way already; so is a run whose captured step
    diverged (is it the graph or the rate?).  After a failed capture, or a divergence that the
    eager retry did not repeat, the later runs of the same family and width are sent eagerly from
    the start (their step is the same code: a restart per run would only cost time)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    share = share or (lambda task: None)
    old: list = []  # processes that left, reaped at the end

    def start():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, settings, root), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def record(row: dict, task: Task) -> None:
        first = book.first_try(task)
        if first is not None:
            row["first_try"] = first
        runs.append(row)
        ladder.done(task, row.get("accuracy"), retry=_retry(row))
        say(_progress(row, len(runs)))

    def restart(i: int, why: str) -> None:
        old.append(workers[i][0])
        for task in busy[i].values():
            record({**_task_row(task), "error": why}, task)
        busy[i].clear()
        workers[i] = start()

    def send(i: int, task: Task) -> None:
        tid = next(ids)
        left = deadline - time.monotonic()
        msg = (tid, task, time.time() + left, share(task), "off" if book.plain(task) else None)
        try:
            workers[i][1].send(msg)
        except (BrokenPipeError, OSError):  # it died idle: a new one takes the task
            restart(i, f"worker died (exit code {workers[i][0].exitcode})")
            workers[i][1].send(msg)
        busy[i][tid] = task

    workers = [start() for _ in range(jobs)]
    busy: dict[int, dict[int, Task]] = {i: {} for i in range(jobs)}
    runs: list[dict] = []
    retries: list[Task] = []  # runs to try again eagerly, before the ladder's next
    book = RetryBook()
    ids = iter(range(1 << 62))
    while True:
        now = time.monotonic()
        if deadline - now > min_run_s:
            # one task per worker in turn, so the cheap and the costly runs spread over the workers
            while not all(busy.values()):
                task = None
                for i in range(jobs):
                    if busy[i]:
                        continue
                    task = retries.pop(0) if retries else ladder.next()
                    if task is None:
                        break
                    send(i, task)
                if task is None:
                    break
        if not any(busy.values()):
            break
        if now >= deadline + grace_s:
            for i in range(jobs):
                if busy[i]:
                    workers[i][0].kill()
                    for task in busy[i].values():
                        record({**_task_row(task), "error": KILLED}, task)
                    busy[i].clear()
            break
        ready = wait([workers[i][1] for i in range(jobs) if busy[i]], timeout=1.0)
        for i in [i for i in range(jobs) if busy[i] and workers[i][1] in ready]:
            conn = workers[i][1]
            try:
                while busy[i] and conn.poll():
                    tid, row, leave = conn.recv()
                    task = busy[i].pop(tid)
                    if book.after(task, row, leave):
                        retries.append(task)
                        say(f"{_progress(row, len(runs))}; retried eagerly")
                    else:
                        record(row, task)
                    if leave:
                        restart(i, f"worker left (exit code {workers[i][0].exitcode})")
                        break
            except (EOFError, OSError):
                restart(i, f"worker died (exit code {workers[i][0].exitcode})")
    for proc, conn in workers:
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    procs = [p for p, _ in workers] + old
    end = time.monotonic() + 10
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for task in retries:  # retries the deadline left unstarted
        record({**_task_row(task), "error": f"{book.first.get(task, '?')} (the eager retry did not start)"}, task)
    return runs


def _task_row(task: Task) -> dict:
    c = task.cell
    return {"family": c.family, "preset": c.preset, "d_model": c.d_model, "seq_len": c.seq_len, "kv_pairs": c.kv_pairs,
            "lr": task.lr, "rung": task.rung}


def _progress(row: dict, n: int) -> str:
    acc = row.get("accuracy")
    head = (f"[{n}] {row['family']:>10} d={row['d_model']:<4} T={row['seq_len']:<4} kv={row['kv_pairs']:<3} "
            f"lr={row['lr']:.1e}: ")
    if acc is None:
        return head + row.get("error", "?")
    return head + f"accuracy {acc:.3f} ({row['steps']} steps, {row['stopped']}, {row['wall_seconds']:.0f} s)"


def best_by_cell(runs: list[dict], cells: list[Cell] | None = None) -> list[dict]:
    """One row per (family, width, seq_len, kv_pairs): the run with the best final test accuracy
    (``accuracy`` None when none finished; ``status`` says why: ``failed`` or ``not run``), with
    the rates tried and whether the best run was cut by the deadline (``partial``)."""
    best: dict[tuple, dict] = {}
    for c in cells or []:
        best[c.key] = {"family": c.family, "preset": c.preset, "d_model": c.d_model, "seq_len": c.seq_len,
                       "kv_pairs": c.kv_pairs, "accuracy": None, "lr": None, "rates": 0, "partial": False,
                       "status": NOT_RUN, "error": None}
    for r in runs:
        key = (r["family"], r["d_model"], r["seq_len"], r["kv_pairs"])
        cur = best.setdefault(key, {"family": r["family"], "preset": r["preset"], "d_model": r["d_model"],
                                    "seq_len": r["seq_len"], "kv_pairs": r["kv_pairs"], "accuracy": None, "lr": None,
                                    "rates": 0, "partial": False, "status": NOT_RUN, "error": None})
        cur["rates"] += 1
        acc = r.get("accuracy")
        if acc is not None and (cur["accuracy"] is None or acc > cur["accuracy"]):
            cur.update(accuracy=acc, lr=r["lr"], partial=r.get("stopped") == "max_seconds", status="done", error=None)
        elif cur["accuracy"] is None:
            cur.update(status="killed" if r.get("error") == KILLED else "failed", error=r.get("error"))
    return sorted(best.values(), key=lambda r: (r["seq_len"], r["family"], r["d_model"]))


# ---------------------------------------------------------------------------------------------- outputs


def _cell_text(r: dict) -> str:
    if r["accuracy"] is None:
        return {"failed": "failed", "killed": "killed"}.get(r["status"], "not run")
    return f"{r['accuracy']:.3f}" + ("†" if r["partial"] else "")


def table(best: list[dict]) -> str:
    """Markdown: one row per family and sequence length, one column per width (best rate; † = the
    best run was stopped by the deadline, ``not run`` = the deadline came first)."""
    widths = sorted({r["d_model"] for r in best})
    lines = ["| family | seq_len / pairs | " + " | ".join(f"d={w}" for w in widths) + " |",
             "|---|---|" + "---|" * len(widths)]
    for T in sorted({r["seq_len"] for r in best}):
        for fam in sorted({r["family"] for r in best}):
            cells = {r["d_model"]: r for r in best if r["seq_len"] == T and r["family"] == fam}
            if not cells:
                continue
            kv = next(iter(cells.values()))["kv_pairs"]
            vals = [_cell_text(cells[w]) if w in cells else "" for w in widths]
            lines.append(f"| {fam} | {T} / {kv} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def anchor_verdict(best: list[dict], target: float = TARGET, family: str = ANCHOR) -> list[dict]:
    """Per (seq_len, kv_pairs): the anchor family's best accuracy over the widths, the width that
    reached it, and whether it passes ``target``."""
    out = []
    for T, kv in sorted({(r["seq_len"], r["kv_pairs"]) for r in best}):
        rows = [r for r in best if r["family"] == family and r["seq_len"] == T and r["accuracy"] is not None]
        top = max(rows, key=lambda r: r["accuracy"], default=None)
        out.append({"seq_len": T, "kv_pairs": kv, "accuracy": top and top["accuracy"], "d_model": top and top["d_model"],
                    "passes": bool(top and top["accuracy"] > target),
                    "widths_above": sorted(r["d_model"] for r in rows if r["accuracy"] > target)})
    return out


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
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=fam,
                        lw=2.2 if fam == ANCHOR else 1.2)
        kv = next(r["kv_pairs"] for r in best if r["seq_len"] == T)
        ax.set_title(f"seq_len {T}, {kv} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("model width")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy (best rate tried)")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _environment(device: str) -> dict:
    import torch

    from lintime.bench.measure import git_commit

    commit = git_commit() or ""  # LINTIME_GIT_COMMIT where the copy's .git is stale (a remote GPU machine)
    cuda = torch.cuda.is_available() and device != "cpu"
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu"),
            "torch": torch.__version__, "host_cpus": os.cpu_count()}


# ---------------------------------------------------------------------------------------------- the page


BEGIN = "<!-- BEGIN {name}: written by benchmarks/recall_sweep.py --report; edit the script, not this block -->"
END = "<!-- END {name} -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the lines between the ``name`` block's markers replaced by ``body``."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the page must hold the block markers once each, in order:\n{begin}\n{end}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def _rates_tried(best: list[dict]) -> str:
    counts: dict[int, int] = {}
    for r in best:
        counts[r["rates"]] = counts.get(r["rates"], 0) + 1
    return ", ".join(f"{n} cell{'s' * (n != 1)} at {k} rate{'s' * (k != 1)}" for k, n in sorted(counts.items()))


def recall_section(data: dict) -> str:
    """The results block of the page from a ``recall_sweep.json``."""
    st, best = data["settings"], data["best"]
    runs, not_run = data["runs"], data.get("not_run", [])
    if st.get("steps"):
        rows = f"{st['rows']} rows" if st.get("rows") else "Zoology's batch rows"
        budget = f"{st['steps']} steps per run ({st.get('anchor_steps') or st['steps']} for the anchor) of {rows}, " \
                 "the first steps of Zoology's 64-epoch cosine"
    else:
        budget = f"{st['epochs']} epochs per run (Zoology's recipe), cosine over them"
    every = f"every {st['eval_every']} steps" if st.get("eval_every") else "after every epoch"
    if not data.get("jobs"):
        workers = "the runs one after the other in one process"
    else:
        workers = f"{data['jobs']} worker processes sharing the GPU"
    forms: dict[str, int] = {}
    for r in data["runs"]:
        if r.get("step"):
            forms[r["step"]] = forms.get(r["step"], 0) + 1
    if forms:
        workers += "; training steps: " + ", ".join(
            f"{n} run{'s' * (n != 1)} {'in one CUDA graph each' if f == 'capture' else f}" for f, n in sorted(forms.items()))
    lines = [
        f"Measured on {data['device']} ({data.get('host_cpus', '?')} host CPUs), {data['date']}, commit "
        f"`{data['commit'][:10]}`, torch {data['torch']}; {workers}; "
        f"{len(runs)} runs in {data['seconds']:.0f} s (deadline {st['deadline_s']:.0f} s); "
        + (f"{len(not_run)} queued runs not started before the deadline." if not_run else "every queued run ran."),
        "",
        f"Settings: {budget}, test accuracy {every} on {st['test_examples']:,} test examples, stop above {TARGET}; "
        f"vocabulary {st['vocab']}, {st['train_examples']:,} training examples; "
        f"learning-rate ladder {st['lrs']} (a cell takes the next rate only while at or below {TARGET}): "
        f"{_rates_tried(best)}.",
        "",
        f"**Anchor** ({ANCHOR}: Transformer++ with one head and RoPE alone), best accuracy over the widths:",
        "",
        "| seq_len / pairs | best accuracy | at width | widths above 0.99 | passes |",
        "|---|---|---|---|---|",
    ]
    verdict = data.get("anchor") or anchor_verdict(best)
    for a in verdict:
        acc = "not run" if a["accuracy"] is None else f"{a['accuracy']:.4f}"
        lines.append(f"| {a['seq_len']} / {a['kv_pairs']} | {acc} | {a['d_model'] or '-'} | "
                     f"{', '.join(map(str, a['widths_above'])) or 'none'} | {'yes' if a['passes'] else 'no'} |")
    failing = [f"{a['seq_len']} / {a['kv_pairs']}" for a in verdict if not a["passes"]]
    lines += ["", "The anchor passes at every point." if not failing else
              f"The anchor does not pass at {', '.join(failing)}: the sweep's budget is too short there, or the "
              "recipe differs from Zoology's where it matters (see the recipe above); no conclusion about the other "
              "families at those points.", ""]
    lines += [f"MQAR test accuracy at the best rate tried ({st['test_examples']:,} test examples per cell; † the best "
              "run was stopped by the deadline and scored there; `not run`: the deadline came first; `failed`: the "
              "error is in the JSON):", "", table(best), "", "![recall_sweep.png](results/recall_sweep.png)"]
    errors: dict[str, int] = {}
    for r in runs:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    if errors:
        lines += ["", "Errors:", ""] + [f"* {n} x `{e}`" for e, n in sorted(errors.items(), key=lambda x: -x[1])[:10]]
    return "\n".join(lines)


def _length(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def passkey_section(data: dict) -> str:
    """The passkey block of the page from a ``passkey_sweep.json`` (benchmarks/passkey_sweep.py)."""
    st = data["settings"]
    lens = st["lengths"]
    lines = [
        f"Measured on {data['device']}, {data['date']}, commit `{data['commit'][:10]}`, torch {data['torch']}; "
        f"{len(data['models'])} models in {data['seconds']:.0f} s; {st['trials']} prompts per (length, depth), "
        f"{st['digits']}-digit keys at depths {', '.join(f'{d:g}' for d in st['depths'])}, filler {st['filler']}, "
        "greedy decoding through the decoding state. Mean accuracy over the depths (`skipped`: beyond a learned "
        "position table; `not run`: the deadline came first):",
        "",
        "| model | trained at | " + " | ".join(_length(L) for L in lens) + " |",
        "|---|---|" + "---|" * len(lens),
    ]
    for m in data["models"]:
        cells = []
        for L in lens:
            got = [c for c in m.get("cells", []) if c["context_len"] == L]
            if not got:
                cells.append("failed" if m.get("error") else "not run")
            elif any(c.get("skipped") for c in got):
                cells.append("skipped")
            else:
                cells.append(f"{sum(c['correct'] for c in got) / sum(c['trials'] for c in got):.2f}")
        lines.append(f"| {m['name']} | {m.get('trained_context') or '?'} | " + " | ".join(cells) + " |")
    lines += ["", "![passkey_sweep.png](results/passkey_sweep.png)"]
    errors = [f"* {m['name']}: `{m['error']}`" for m in data["models"] if m.get("error")]
    if errors:
        lines += ["", "Errors:", ""] + errors
    return "\n".join(lines)


def status_section(recall: dict | None, passkey: dict | None) -> str:
    parts = []
    if recall is not None:
        parts.append(f"the MQAR sweep ran on {recall['device']} on {recall['date']}")
    if passkey is not None:
        parts.append(f"passkey retrieval on {passkey['device']} on {passkey['date']}")
    return ("**Status:** " + "; ".join(parts) + ". The numbers below are written from the JSON by "
            "`benchmarks/recall_sweep.py --report`.") if parts else "**Status: not yet run.**"


def write_report(recall_json: Path, passkey_json: Path | None, page: Path) -> str:
    """Fill the page's generated blocks from the sweeps' JSON, copy the JSON and draw the plots
    into ``results/`` beside the page; returns what it wrote."""
    recall = json.loads(recall_json.read_text())
    passkey = json.loads(passkey_json.read_text()) if passkey_json else None
    text = page.read_text()
    text = replace_block(text, "status", status_section(recall, passkey))
    text = replace_block(text, "recall-results", recall_section(recall))
    images = page.parent / "results"
    images.mkdir(parents=True, exist_ok=True)
    # the JSON kept beside the page (the numbers' source); the plots drawn again from it (the GPU
    # machine may lack matplotlib)
    written = [images / "recall_sweep.json", images / "recall_sweep.png"]
    if recall_json.resolve() != written[0].resolve():
        shutil.copy(recall_json, written[0])
    plot(recall["best"], written[1])
    if passkey is not None:
        import passkey_sweep

        text = replace_block(text, "passkey-results", passkey_section(passkey))
        written += [images / "passkey_sweep.json", images / "passkey_sweep.png"]
        if passkey_json.resolve() != written[2].resolve():
            shutil.copy(passkey_json, written[2])
        passkey_sweep.plot(passkey, written[3])
    page.write_text(text)
    return f"wrote {page}, " + ", ".join(map(str, written))



# ---------------------------------------------------------------------------------------------- main


def time_shares(cells: list[Cell], settings: dict, jobs: int, deadline_s: float) -> tuple[float, float]:
    """Seconds of training a run may take after its first step, ``(other runs, anchor runs)``: the
    workers' time to the deadline (less :data:`SHARE_RESERVE_S`, and :data:`RUN_OVERHEAD_S` per
    run) spread over the first rung's runs in proportion to their step budgets (the anchor's larger).  A share binds only where the steps
    are slower than the deadline allows for the whole first rung; time the shares leave (early
    stops, fast steps) goes to the later rungs."""
    steps = settings["steps"] or 1
    ratio = (settings["anchor_steps"] or steps) / steps
    units = sum(ratio if c.family == ANCHOR else 1.0 for c in cells)
    unit = max(1.0, (jobs * (deadline_s - SHARE_RESERVE_S) - len(cells) * RUN_OVERHEAD_S) / max(units, 1.0))
    return unit, unit * ratio


def summarize(runs: list[dict], not_run: list[dict], seconds: float) -> dict:
    """Runs finished / killed / failed, steps per second over the sweep, the step forms."""
    killed = sum(r.get("error") == KILLED for r in runs)
    failed = sum("error" in r and r.get("error") != KILLED for r in runs)
    steps = sum(r.get("steps") or 0 for r in runs)
    forms: dict[str, int] = {}
    for r in runs:
        if r.get("step"):
            forms[r["step"].split(" (")[0]] = forms.get(r["step"].split(" (")[0], 0) + 1
    return {"finished": len(runs) - killed - failed, "killed": killed, "failed": failed,
            "diverged": sum(bool(r.get("diverged")) for r in runs), "not_started": len(not_run),
            "retried_eagerly": sum("first_try" in r for r in runs), "steps": steps, "seconds": round(seconds, 1),
            "steps_per_s": round(steps / max(seconds, 1e-9), 1), "step_forms": forms,
            "capped": sum(r.get("stopped") == "max_seconds" for r in runs)}


def summary_line(s: dict) -> str:
    forms = ", ".join(f"{n} {f}" for f, n in sorted(s["step_forms"].items())) or "none"
    return (f"summary: {s['finished']} runs finished ({s['capped']} cut by time), {s['killed']} killed, "
            f"{s['failed']} failed ({s['diverged']} diverged), {s['not_started']} not started, "
            f"{s['retried_eagerly']} retried eagerly; {s['steps']:,} steps in {s['seconds']:.0f} s = "
            f"{s['steps_per_s']:.0f} steps/s; step forms: {forms}")


def healthy(s: dict) -> bool:
    """The smoke check's verdict: no run killed at the deadline, no failure but divergences."""
    return s["killed"] == 0 and s["failed"] == s["diverged"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for recall_sweep.json / .md / .png (and the runs, with --keep-runs)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long CPU check of the script (tiny sizes, one rate)")
    p.add_argument("--smoke", action="store_true",
                   help="a ~1-minute GPU self-check (every family at 64/4, widths 64 and 512, 100 steps a run; "
                        "warms Triton's cache): exit status 1 if a run was killed or failed other than by diverging")
    p.add_argument("--families", default="", help="families to run, comma-separated (default: every registered one)")
    p.add_argument("--widths", default=",".join(map(str, ZOOLOGY_WIDTHS)))
    p.add_argument("--points", default=",".join(f"{T}/{kv}" for T, kv in ZOOLOGY_POINTS), help="seq_len/kv_pairs, ...")
    p.add_argument("--lrs", default=",".join(f"{lr:.3g}" for lr in ZOOLOGY_LRS),
                   help="the learning-rate ladder, in the order tried (a cell takes the next only below 0.99)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--train-examples", type=int, default=100_000)
    p.add_argument("--test-examples", type=int, default=3_000)
    p.add_argument("--epochs", type=int, default=64, help="Zoology's 64; --steps binds first")
    p.add_argument("--rows", type=int, default=64, help="batch rows at every length; 0 = Zoology's (512-128)")
    p.add_argument("--steps", type=int, default=1000, help="steps per run (a cut of Zoology's schedule); 0 = all of it")
    p.add_argument("--anchor-steps", type=int, default=4000,
                   help="steps per run of the anchor (softmax) family; 0 = --steps (see the module docstring)")
    p.add_argument("--eval-every", type=int, default=200, help="steps between test evaluations (early stop)")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"worker processes (default: {CUDA_JOBS} on CUDA, 0 = in this process on a CPU)")
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="wall-clock budget: runs in flight stop there, the rest are recorded as not run")
    p.add_argument("--grace-s", type=float, default=30.0, help="kill a run still going this long after the deadline")
    p.add_argument("--min-run-s", type=float, default=20.0, help="start no run with less than this left")
    p.add_argument("--run-seconds", type=float, default=None,
                   help="training seconds a run may take after its first step (the anchor's: x anchor-steps / steps); "
                        "default: the workers' time to the deadline shared over the first rung (time_shares); 0 = none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", help="auto = bf16 autocast on CUDA, fp32 on a CPU")
    p.add_argument("--graph", default="auto", choices=("auto", "capture", "eager", "off"),
                   help="the training step: auto = one CUDA graph on CUDA (capture), the plain loop elsewhere (off)")
    p.add_argument("--keep-runs", action="store_true", help="keep every run folder (default: deleted after scoring)")
    p.add_argument("--report", metavar="JSON", help="write docs/results_recall.md from this recall_sweep.json and exit")
    p.add_argument("--passkey", metavar="JSON", help="with --report: passkey_sweep.json for the passkey section")
    p.add_argument("--page", default=str(Path(__file__).resolve().parents[1] / "docs" / "results_recall.md"),
                   help="with --report: the page to fill")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.report:
        print(write_report(Path(args.report), Path(args.passkey) if args.passkey else None, Path(args.page)))
        return 0
    if not args.out:
        p.error("--out is required (or --report)")
    if args.smoke:  # the self-check's values for the options left at their defaults
        smoke = dict(widths="64,512", points="64/4", lrs="2.2e-3", steps=100, anchor_steps=100, eval_every=50,
                     test_examples=512, deadline_s=45.0, grace_s=20.0, min_run_s=10.0)
        for k, v in smoke.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if args.tiny:  # tiny values for the options left at their defaults
        tiny = dict(widths="16,32", points="16/2", lrs="3e-3", vocab=32, train_examples=64, test_examples=32, epochs=1,
                    device="cpu", steps=0, anchor_steps=0, eval_every=0, rows=0)
        for k, v in tiny.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)

    import torch

    device = args.device
    cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda")
    jobs = args.jobs if args.jobs is not None else (CUDA_JOBS if cuda else 0)
    if not cuda:
        torch.set_num_threads(1)
    presets = family_presets()
    if args.families:
        wanted = [f.strip() for f in args.families.split(",")]
        unknown = [f for f in wanted if f not in presets]
        if unknown:
            p.error(f"unknown families {unknown}; registered: {sorted(presets)}")
        presets = {f: presets[f] for f in wanted}
    cells = make_cells(presets, _parse_points(args.points), [int(w) for w in args.widths.split(",")])
    lrs = [float(x) for x in args.lrs.split(",")]
    ladder = Ladder(cells, lrs)
    settings = {"vocab": args.vocab, "rows": args.rows or None, "train_examples": args.train_examples,
                "test_examples": args.test_examples,
                "epochs": args.epochs, "steps": args.steps or None, "anchor_steps": args.anchor_steps or None,
                "eval_every": args.eval_every or None,
                "seed": args.seed, "device": device, "precision": args.precision, "keep_runs": args.keep_runs,
                "graph": args.graph}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = str(out / "runs") if args.keep_runs else tempfile.mkdtemp(prefix="recall-runs-")
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    print(f"recall sweep: {len(cells)} cells x up to {len(lrs)} rates, {args.steps or 'Zoology'} steps per run, "
          f"{jobs or 'no'} worker processes, deadline {args.deadline_s:.0f} s", flush=True)
    say = lambda line: print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True)  # noqa: E731
    if jobs:
        if args.run_seconds is None:
            other, anchor = time_shares(cells, settings, jobs, args.deadline_s)
        else:
            other = args.run_seconds or None
            anchor = other and other * (settings["anchor_steps"] or 1) / (settings["steps"] or 1)
        share = lambda task: anchor if task.cell.family == ANCHOR else other  # noqa: E731
        if other:
            say(f"time share per run after its first step: {other:.0f} s ({anchor:.0f} s for the anchor)")
        runs = sweep_pool(ladder, settings, root, jobs, deadline, min_run_s=args.min_run_s, grace_s=args.grace_s,
                          say=say, share=share)
    else:
        data: dict = {}  # the examples of each setting, drawn once for all its runs
        runs = sweep_in_process(ladder, lambda task, left: run_task(task, settings, root, left, data), deadline,
                                min_run_s=args.min_run_s, say=say)
    not_run = [{**_task_row(t), "status": NOT_RUN} for t in ladder.pending()]
    if not args.keep_runs:
        shutil.rmtree(root, ignore_errors=True)
    best = best_by_cell(runs, cells)
    summary = summarize(runs, not_run, time.monotonic() - t0)
    result = {
        **_environment(device), "jobs": jobs,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "report", "passkey", "page")},
        "seconds": round(time.monotonic() - t0, 1), "anchor": anchor_verdict(best), "best": best, "runs": runs,
        "not_run": not_run, "summary": summary,
    }
    (out / "recall_sweep.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "recall_sweep.md").write_text(table(best) + "\n")
    try:
        plot(best, out / "recall_sweep.png")
    except ImportError as err:  # the results are in the JSON; --report draws the plot where matplotlib is
        print(f"no plot ({err}); --report draws it from the JSON")
    print(table(best))
    print(f"{len(runs)} runs, {len(not_run)} not run; wrote {out / 'recall_sweep.json'}, recall_sweep.md and "
          f"recall_sweep.png ({result['seconds']:.0f} s)")
    print(summary_line(summary), flush=True)
    if args.smoke:
        ok = healthy(summary)
        print(f"smoke: {'ok' if ok else 'NOT OK (a run was killed or failed: see recall_sweep.json)'}", flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
