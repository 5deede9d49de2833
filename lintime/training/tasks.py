"""Training on a synthetic task (``lintime train --task mqar``) with the Zoology study's recipe.

The recipe (Zoology, ``zoology/train.py`` and ``zoology/config.py``; its Figure 2 sweep in
``zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py``):

* data: a fixed set of ``train_examples`` MQAR examples (100 000), ``test_examples`` held-out
  ones (3 000) from another generator stream; batch 512 rows at ``seq_len`` <= 128, 256 at 256,
  128 at 512, 64 above;
* model: the preset at width ``d_model`` (swept over 64, 128, 256, 512), 2 layers, vocabulary
  8192, blocks of the sequence mixer alone (Zoology's Figure 2 blocks have no MLP: ``mlp=False``
  drops the preset's feed-forward; a family whose mixer holds its own, FLASH / GAU, keeps it);
  Zoology's attention has one head (``n_heads=1``; ``None`` keeps the preset's);
* optimiser: AdamW (betas 0.9 / 0.999, eps 1e-8), weight decay 0.1 on every parameter, no
  warm-up, no gradient clipping; the learning rate follows a cosine from ``lr`` to 0 over
  ``epochs`` (64), stepped once per epoch; Zoology sweeps ``lr`` over 1e-4, 4.6e-4, 2.2e-3, 1e-2
  and reports the best;
* after each epoch the test accuracy; training stops once it exceeds ``early_stop`` (0.99).

A **mixture of points** (``mix``; ``lintime train --task mqar --mqar-mix zoology``): Zoology's multi-point
training (the Based paper's MQAR sweep, ``zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py``:
64/4 x 100 000, 128/8, 256/16, 256/32, 256/64 x 20 000 each, one model for all of them).  Every batch holds each
point in its exact proportion (:func:`~lintime.evaluation.tasks.mqar.mix_rows`: 140 + 4 x 28 of 252 rows for
Zoology's mix), each row padded on the right to the longest point with filler inputs and unscored targets
(:class:`~lintime.evaluation.tasks.mqar.MQARMixData`): a causal model's scored positions never see the padding,
and the loss is the queried values' cross-entropy over the batch, as for one point.  (Zoology shuffles its
examples into batches whose mixture varies; fixed shares keep the batch's shape and target count fixed, so the
step stays one CUDA graph.)  The test accuracy is taken at each point; the run's accuracy (early stop, best)
is the lowest point's, and ``metrics.jsonl`` has each point's (``val_points``) and the pooled one.

What differs from Zoology: the blocks are lintime's (pre-norm, the preset's norm and position
scheme), there is no dropout (Zoology: 0.1 on the embedding and inside attention), and the loss
is computed at the queried positions only (the hidden states there through the output
projection: the same loss and gradients as on all logits, as no other position has a target).
Transformer-VQ's commitment loss is added with ``aux_weight`` (1e-4, the LM recipes' weight).
On CUDA the whole step (forward, backward, fused AdamW) is one CUDA graph replay
(:class:`TaskRun`): a narrow model's eager step is hundreds of launches of kernels that each run
for microseconds, so launches, not the GPU, set its time.

A time-boxed run (the recall sweep on one GPU) is the start of Zoology's: ``max_steps`` cuts it
(the cosine keeps its 64-epoch length, so a short run trains near the peak rate, as the first
epochs of Zoology's runs do), the test accuracy is taken every ``eval_every`` steps instead of
once per epoch (the cosine is then stepped at each evaluation), and ``max_seconds`` stops it at
a wall-clock budget (scored there).  Without those three the run is Zoology's: one evaluation
and one cosine step per epoch.

The MQAR task itself -- its setting, examples, the loss on the queried positions (:func:`query_loss`,
:class:`QueryLoss`), the examples kept on the device (:class:`MQARData`) and the test accuracy -- is
:mod:`lintime.evaluation.tasks.mqar`; the run's settings are :mod:`lintime.training.task_config`.

The run folder has the layout of :mod:`lintime.training.checkpoint` (``config.json`` with a
``task`` entry in ``train``, the byte tokenizer -- the contract needs one; the task's token ids
are its own -- and one checkpoint at the end), plus ``metrics.jsonl`` (one row per epoch) and
``accuracy_vs_epoch.png``.  ``lintime eval RUN --task mqar`` scores it again.  A task run is not
resumable (minutes on a GPU): run it again.  SIGINT / SIGTERM (:func:`train_task`) stop it after the
current step: the steps since the last evaluation are scored (a metrics row for the partial
epoch) and the checkpoint is saved, as at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from lintime.evaluation.tasks.mqar import (
    MQARData,
    MQARMixData,
    QueryLoss,
    data_key,
    evaluate_mqar,
    format_mix,
    query_loss,
    task_data,
)
from lintime.models import CausalLM
from lintime.training import checkpoint as ckpt
from lintime.training.rng import seed_everything
from lintime.training.step import forward_backward
from lintime.training.task_config import (
    GRAPH_MODES,
    TASKS,
    TaskTrainConfig,
    cosine_lr,
    schedule,
    zoology_batch_size,
)
from lintime.utils.device import autocast_dtype, pick_device

# named here too: what a sweep or a test imports from the task trainer
__all__ = ["GRAPH_MODES", "TASKS", "CaptureFailed", "MQARData", "MQARMixData", "QueryLoss", "TaskRun", "TaskTrainConfig",
           "TaskTrainResult", "cosine_lr", "plot_task_metrics", "query_loss", "schedule", "train_task",
           "zoology_batch_size"]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "accuracy_vs_epoch.png"


class _Rows(NamedTuple):
    """A batch of whole rows, each one example, as :func:`lintime.training.step.forward_backward` takes it
    with ``packed=False``."""

    input_ids: torch.Tensor
    targets: torch.Tensor


@dataclasses.dataclass
class TaskTrainResult:
    run_dir: Path
    steps: int
    epochs: int
    accuracy: float  # test accuracy at the last evaluation
    best_accuracy: float
    seconds: float  # training wall time (without the test evaluations)
    checkpoint: Path | None  # None: stopped by a signal before the first step
    stopped: str = "epochs"  # why it ended: "early stop", "epochs", "max_steps", "max_seconds" or a signal's name
    stopped_by: str | None = None  # the signal that stopped it ("SIGINT", "SIGTERM"), None when it ran to its end
    point_accuracy: dict[str, float] | None = None  # a mix: each point's test accuracy at the last evaluation


class CaptureFailed(RuntimeError):
    """The training step did not capture in a CUDA graph (a :class:`TaskRun` with ``fallback=False``)."""


class TaskRun:
    """One task run, stepped from outside: :meth:`advance` trains up to a number of steps (never
    past the next evaluation) and evaluates when it reaches one; it returns True once the run has
    ended (:attr:`stopped` says why), and :meth:`finish` saves it.  :func:`train_task` is the loop
    ``while not run.advance(): pass``; a sweep interleaves several runs in one process (each on its
    own CUDA stream) by advancing them in turn.

    The step (``config.graph``): ``capture`` -- :class:`lintime.training.graphed.GraphedStep`, the
    whole step (forward, backward, fused AdamW at a device learning rate) in one CUDA graph, the
    default on CUDA: a tiny model's eager step is hundreds of kernel launches of a few microseconds
    each; ``eager`` -- the same step without the graph (what the captured one is checked against);
    ``off`` -- the plain loop, :func:`lintime.training.step.forward_backward` and AdamW (the default
    elsewhere, and where the capture fails; ``fallback=False``: a failed capture raises
    :class:`CaptureFailed` instead, for a caller that would rather retry the run in a fresh process
    than go on in one whose capture failed).  ``data``: the run's
    :class:`~lintime.evaluation.tasks.mqar.MQARData` (one is made when None).  :attr:`timing` says
    where the run's time went."""

    def __init__(self, config: TaskTrainConfig, *, out: str | Path = "runs", name: str | None = None,
                 echo: Callable[[str], None] | None = print, plot: bool = True,
                 data: MQARData | MQARMixData | None = None,
                 fallback: bool = True):
        from lintime.data import ByteTokenizer
        from lintime.training.graphed import GraphedStep

        self.say = say = echo or (lambda line: None)
        self.started = time.perf_counter()
        self.cfg = cfg = config
        self.plot, self.fallback = plot, fallback
        task = cfg.mqar
        device = pick_device(cfg.device)
        if cfg.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, got {cfg.precision!r}")
        self.amp = amp = autocast_dtype(device, cfg.precision)
        self.model_cfg = model_cfg = cfg.model_config()
        seed_everything(cfg.seed if cfg.init_seed is None else cfg.init_seed)  # the initial weights only
        self.model = model = CausalLM(model_cfg).to(device)
        model.train()
        if data is None:
            data = task_data(cfg, device)
        elif data.key != data_key(cfg, device):
            raise ValueError("the given MQARData holds another setting's examples")
        self.data, self.device = data, device

        where = f"T{cfg.seq_len}-kv{cfg.kv_pairs}" if cfg.mix is None else f"mix{len(cfg.mix)}-T{cfg.seq_len}"
        self.run_dir = run_dir = Path(out) / (name or f"{cfg.task}-{cfg.preset}-d{model_cfg.d_model}-{where}")
        if (run_dir / ckpt.CONFIG_FILE).exists():
            raise ValueError(f"run folder {run_dir} already holds a run: pick another --name")
        ckpt.write_run_config(run_dir, model_config=model_cfg, objective="clm", tokenizer=ByteTokenizer(), train=cfg.to_dict())
        self.metrics_path = run_dir / METRICS_FILE
        self.metrics_path.write_text("")

        # fused AdamW: the graph needs it, and eagerly it is a few kernels instead of one per tensor
        fused = device.type in ("cuda", "cpu")
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
        self.rows = rows = cfg.rows
        self.n_batches = cfg.train_examples // rows  # whole batches of the fixed training set
        self.total, self.stage, self.stages = schedule(cfg)
        mode = cfg.graph if cfg.graph != "auto" else ("capture" if device.type == "cuda" else "off")
        self.loss_module = QueryLoss(model, cfg.queries)
        self.form = mode  # the step taken; "off (...)" once a capture failed
        self.graphed = None
        if mode != "off":
            self.graphed = GraphedStep(self.loss_module, self.opt, rows=rows, context_len=cfg.seq_len, clip=0.0,
                                       aux_weight=cfg.aux_weight, autocast=amp, capture=mode == "capture", notice=say)
        say(f"lintime train --task {cfg.task}: {cfg.preset} d_model {model_cfg.d_model} x {model_cfg.n_layers} layers "
            f"({model.num_parameters() / 1e6:.2f}M parameters), {device.type}{' bf16' if amp is not None else ' fp32'}"
            f", step {mode}")
        if cfg.mix is None:
            say(f"  mqar: vocab {task.vocab_size}, seq_len {task.seq_len}, {task.kv_pairs} pairs, {task.queries} "
                f"queries; {self.n_batches * rows:,} train / {cfg.test_examples:,} test examples, batch {rows}")
        else:
            shares = ", ".join(f"{p.seq_len}/{p.kv_pairs}: {r} rows ({self.n_batches * r:,} examples)"
                               for p, r in zip(cfg.points, cfg.point_rows))
            say(f"  mqar mix {format_mix(cfg.mix)}: vocab {task.vocab_size}, rows padded to {cfg.seq_len} tokens; "
                f"batch {rows} = {shares}; {cfg.test_examples:,} test examples per point, the run stops early "
                "on the lowest point's accuracy")
        say(f"  recipe zoology: AdamW lr {cfg.lr:g} (cosine over {self.stages} "
            f"{'epochs' if self.stage == self.n_batches else 'evaluations'} of {self.stage} steps), "
            f"weight decay {cfg.weight_decay:g}, stop at accuracy > {cfg.early_stop:g}"
            f"{'' if cfg.max_seconds is None else f' or after {cfg.max_seconds:g} s'}; run folder {run_dir}")
        epochs = self.total / self.n_batches
        say(f"  plan: {self.total:,} steps ({epochs:.3g} epoch{'' if epochs == 1 else 's'} of {self.n_batches} steps), "
            f"a test evaluation every {self.stage} steps"
            f"{f', stopping early once the test accuracy passes {cfg.early_stop:g}' if cfg.early_stop else ''}")

        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.order: list[int] = []
        self.step, self.elapsed, self.accuracy, self.best, self.stopped = 0, 0.0, 0.0, 0.0, None
        self.point_accuracy: dict[str, float] | None = None  # a mix: each point's at the last evaluation
        self.stopped_by: str | None = None  # the signal that stopped the run (:meth:`interrupt`)
        self.evaluated = False  # at least one test evaluation taken
        self.lr = cfg.lr
        self.loss_sum = torch.zeros((), device=device)  # summed on the device: no host read per step
        self.taken = 0
        self.stop_at = math.inf if cfg.max_seconds is None else self.started + cfg.max_seconds
        # seconds: the build; the first step (with the graph's warm-up and capture); the test evaluations
        self.timing = {"setup_s": 0.0, "first_step_s": 0.0, "eval_s": 0.0}
        self.t0 = time.perf_counter()
        self.timing["setup_s"] = round(self.t0 - self.started, 3)

    @property
    def done(self) -> bool:
        return self.stopped is not None

    @property
    def train_seconds(self) -> float:
        """Training wall time so far (without the test evaluations)."""
        return self.elapsed + (0.0 if self.done else time.perf_counter() - self.t0)

    def interrupt(self, signal_name: str) -> None:
        """End the run at the current step (a signal, between two steps): the steps taken since
        the last evaluation are scored (a metrics row for the partial epoch); :meth:`finish` then
        saves it.  A run that has already ended stays as it ended."""
        if self.done:
            return
        if self.taken:
            self._evaluate(False)
        if self.done:  # the evaluation ended it (early stop): it is complete after all
            return
        self.stopped = self.stopped_by = signal_name

    def limit(self, seconds: float) -> None:
        """Stop (and score) the run ``seconds`` from now, or at the limit already set if sooner."""
        self.stop_at = min(self.stop_at, time.perf_counter() + seconds)

    def _eager_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The plain step: :func:`~lintime.training.step.forward_backward` on the rows (one micro-batch; every
        example scores ``queries`` values, so the targets are counted without a host read), then AdamW."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        ce, aux = forward_backward(self.loss_module, _Rows(x, y), micro_rows=self.rows, aux_weight=self.cfg.aux_weight,
                                   autocast=self.amp, n_targets=self.cfg.batch_targets, packed=False,
                                   to_host=False)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return ce.float() + aux.float()  # the step's loss as the graph's step gives it (fp32)

    def advance(self, max_steps: int | None = None) -> bool:
        """Train up to ``max_steps`` steps (None: to the next evaluation), evaluate if there; True
        once the run has ended."""
        cfg = self.cfg
        for _ in range(max_steps if max_steps is not None else self.stage):
            if self.done:
                break
            if self.step % self.stage == 0:
                self.lr = cosine_lr(cfg.lr, self.step // self.stage, self.stages)
            if not self.order:  # a new epoch: the fixed batches in a new order
                self.order = torch.randperm(self.n_batches, generator=self.gen).tolist()
            x, y = self.data.batch(self.order.pop(0) * self.rows, self.rows)
            first = time.perf_counter() if self.step == 0 else None
            out = self.graphed.step(x, y, self.lr) if self.graphed is not None else None
            if out is None:  # the plain loop, or a capture that failed (no step taken: the eager one takes it)
                if self.graphed is not None:
                    if not self.fallback:
                        raise CaptureFailed(f"the step does not capture in a CUDA graph: {self.graphed.failed}")
                    self.form, self.graphed = f"off (the capture failed: {self.graphed.failed})", None
                self.loss_sum += self._eager_step(x, y)
            else:
                self.loss_sum += out.loss + out.aux
            self.step += 1
            self.taken += 1
            now = time.perf_counter()
            if first is not None:
                self.timing["first_step_s"] = round(now - first, 3)
            over_time = now >= self.stop_at
            if self.step % self.stage == 0 or self.step >= self.total or over_time:
                self._evaluate(over_time)
                break
        return self.done

    def _evaluate(self, over_time: bool) -> None:
        cfg = self.cfg
        self.elapsed += time.perf_counter() - self.t0
        mean_loss = float(self.loss_sum) / self.taken
        if not math.isfinite(mean_loss):
            raise ValueError(f"training diverged by step {self.step} (mean loss {mean_loss}); try a lower --lr")
        t_eval = time.perf_counter()
        if cfg.mix is None:
            res = evaluate_mqar(self.model, cfg.mqar, n_examples=cfg.test_examples, seed=cfg.seed, autocast=self.amp,
                                examples=self.data.test)
            val_loss, score, extra = res.loss, res.accuracy, {}
        else:  # every point; the run's score is the lowest point's accuracy
            results = [evaluate_mqar(self.model, p, n_examples=cfg.test_examples, seed=cfg.seed, autocast=self.amp,
                                     examples=ex) for p, ex in zip(cfg.points, self.data.test)]
            queries = sum(r.n_queries for r in results)
            val_loss = sum(r.loss * r.n_queries for r in results) / queries
            self.point_accuracy = {f"{p.seq_len}/{p.kv_pairs}": r.accuracy for p, r in zip(cfg.points, results)}
            score = min(r.accuracy for r in results)
            extra = {"val_accuracy_pooled": sum(r.accuracy * r.n_queries for r in results) / queries,
                     "val_points": self.point_accuracy}
        self.timing["eval_s"] = round(self.timing["eval_s"] + time.perf_counter() - t_eval, 3)
        self.accuracy, self.best = score, max(self.best, score)
        self.evaluated = True
        epoch = self.step / self.n_batches
        row = {"epoch": round(epoch) if self.step % self.n_batches == 0 else round(epoch, 4), "step": self.step,
               "time_s": round(self.elapsed, 3), "lr": self.lr, "loss": mean_loss, "val_loss": val_loss,
               "val_accuracy": self.accuracy, **extra}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.say(f"epoch {row['epoch']:>6}  step {self.step:>6}  train loss {mean_loss:.4f}  test loss {val_loss:.4f}  "
                 f"accuracy {self.accuracy:.4f}" + ("" if cfg.mix is None else " (lowest point; "
                 + ", ".join(f"{k} {v:.4f}" for k, v in self.point_accuracy.items()) + ")"))
        if cfg.early_stop and self.accuracy > cfg.early_stop:
            self.stopped = "early stop"
        elif over_time:
            self.stopped = "max_seconds"
        elif self.step >= self.total:
            self.stopped = "epochs" if cfg.max_steps is None or self.total < cfg.max_steps else "max_steps"
        else:
            self.loss_sum.zero_()
            self.taken = 0
            self.t0 = time.perf_counter()

    def finish(self) -> TaskTrainResult:
        """Save the run (one checkpoint, the plot) and return its result (no checkpoint when it
        was stopped by a signal before its first step)."""
        cfg, step = self.cfg, self.step
        epochs_done = math.ceil(step / self.n_batches)
        self.model.eval()
        state = {"format": 1, "step": step, "epoch": epochs_done, "elapsed_s": self.elapsed, "accuracy": self.accuracy}
        last = None
        if step > 0 or self.stopped_by is None:
            last = ckpt.save_checkpoint(self.run_dir, step, self.model, state, keep=1)
        if self.plot:
            what = f"T={cfg.seq_len} kv={cfg.kv_pairs}" if cfg.mix is None else f"mix of {len(cfg.mix)} points (lowest)"
            plot_task_metrics(self.run_dir, title=f"{cfg.preset} d{self.model_cfg.d_model}, MQAR {what}")
        self.say(f"{'done' if self.stopped_by is None else 'stopped'} ({self.stopped}): {step} steps "
                 f"({step / self.n_batches:.2f} epochs) in {self.elapsed / 60:.1f} min; test accuracy "
                 f"{self.accuracy:.4f} (best {self.best:.4f}); saved {last or 'nothing (no step taken)'}")
        return TaskTrainResult(run_dir=self.run_dir, steps=step, epochs=epochs_done, accuracy=self.accuracy,
                               best_accuracy=self.best, seconds=self.elapsed, checkpoint=last,
                               stopped=self.stopped or "epochs", stopped_by=self.stopped_by,
                               point_accuracy=self.point_accuracy)


def train_task(
    config: TaskTrainConfig,
    *,
    out: str | Path = "runs",
    name: str | None = None,
    echo: Callable[[str], None] | None = print,
    plot: bool = True,
    data: MQARData | None = None,
    progress: bool = False,
) -> TaskTrainResult:
    """Train ``config`` into ``out/name`` with the recipe of the module docstring (``plot``: draw
    ``accuracy_vs_epoch.png`` at the end; ``data``: :class:`TaskRun`'s).

    ``progress``: a progress bar on stderr (a terminal; elsewhere a line every 30 seconds), as
    ``lintime train`` shows for a language model.  ``echo`` also gets, after the first steps, the
    measured time per step and what the whole plan takes at that rate.  SIGINT / SIGTERM stop the
    run after the current step (:meth:`TaskRun.interrupt`), save it, and return a result whose
    ``stopped_by`` names the signal (a second signal interrupts at once)."""
    from lintime.training.runguard import StopSignals
    from lintime.training.trainer import _Bar  # lintime train's progress bar, shared

    run = TaskRun(config, out=out, name=name, echo=echo, plot=plot, data=data)
    say = run.say
    bar = _Bar(run.total, 0, progress, unit="step")
    plain = progress and not sys.stderr.isatty()  # no tqdm bar (and its time left): the plain lines say it
    rate: float | None = None  # seconds per step after the first (the first one warms up)
    with StopSignals() as stop:
        try:
            while not (run.done or stop.received):
                run.advance(1)  # one step at a time: the signal is seen after the step it lands in
                if rate is None and run.step > 1:
                    spent = run.train_seconds - run.timing["first_step_s"]
                    if run.step >= 21 or spent >= 5.0:
                        rate = spent / (run.step - 1)
                        if not run.done:
                            say(f"  timing: {rate:.3g} s per step: the plan's {run.total:,} steps take "
                                f"~{_duration(rate * run.total)} of training (plus the test evaluations); "
                                "Ctrl-C stops it and saves the checkpoint")
                postfix = f"epoch {run.step / run.n_batches:.2f} lr {run.lr:.2e}"
                if run.evaluated:
                    postfix += f" accuracy {run.accuracy:.4f}"
                if plain and rate is not None:
                    postfix += f" ~{_duration(rate * (run.total - run.step))} left"
                bar.update(1, postfix)
        finally:
            bar.close()
    if stop.received:
        run.interrupt(stop.received)
    return run.finish()


def _duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads: 40 s, 3.5 min, 1.7 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def plot_task_metrics(run_dir: str | Path, *, title: str = "") -> Path | None:
    """``accuracy_vs_epoch.png`` from the run's ``metrics.jsonl`` (None when it holds no row)."""
    from lintime.evaluation.tasks.report import figure

    path = Path(run_dir) / METRICS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if not rows:
        return None
    out = Path(run_dir) / PLOT_FILE
    with figure(out, title, "epoch", "test accuracy") as ax:
        ax.plot([r["epoch"] for r in rows], [r["val_accuracy"] for r in rows], "o-", ms=3)
        ax.set_ylim(-0.02, 1.02)
    return out
