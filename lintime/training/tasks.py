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

What differs from Zoology: the blocks are lintime's (pre-norm, the preset's norm and position
scheme), there is no dropout (Zoology: 0.1 on the embedding and inside attention), and the loss
is computed at the queried positions only (the hidden states there through the output
projection: the same loss and gradients as on all logits, as no other position has a target).
Transformer-VQ's commitment loss is added with ``aux_weight`` (1e-4, the LM recipes' weight).

A time-boxed run (the recall sweep on one GPU) is the start of Zoology's: ``max_steps`` cuts it
(the cosine keeps its 64-epoch length, so a short run trains near the peak rate, as the first
epochs of Zoology's runs do), the test accuracy is taken every ``eval_every`` steps instead of
once per epoch (the cosine is then stepped at each evaluation), and ``max_seconds`` stops it at
a wall-clock budget (scored there).  Without those three the run is Zoology's: one evaluation
and one cosine step per epoch.

The run folder has the layout of :mod:`lintime.training.checkpoint` (``config.json`` with a
``task`` entry in ``train``, the byte tokenizer -- the contract needs one; the task's token ids
are its own -- and one checkpoint at the end), plus ``metrics.jsonl`` (one row per epoch) and
``accuracy_vs_epoch.png``.  ``lintime eval RUN --task mqar`` scores it again.  A task run is not
resumable (minutes on a GPU): run it again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lintime.evaluation.tasks.mqar import IGNORE_INDEX, MQARConfig, evaluate_mqar, mqar_examples
from lintime.models import CausalLM, get_preset
from lintime.training import checkpoint as ckpt
from lintime.training.rng import seed_everything
from lintime.utils.device import autocast_dtype, pick_device

TASKS = ("mqar",)
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "accuracy_vs_epoch.png"


def zoology_batch_size(seq_len: int) -> int:
    """Rows per batch of Zoology's Figure 2 sweep for a sequence length."""
    return 512 if seq_len <= 128 else 256 if seq_len <= 256 else 128 if seq_len <= 512 else 64


@dataclasses.dataclass(frozen=True)
class TaskTrainConfig:
    """Everything that decides a task run (the ``train`` entry of its ``config.json``).

    ``task`` (``mqar``), ``preset`` with ``d_model`` / ``n_layers`` / ``n_heads`` overrides
    (``None`` = the preset's), ``mlp`` (keep the preset's feed-forward blocks) and ``position``
    (the absolute position scheme: ``none``, ``scaled_sin`` or ``learned`` with a table of
    ``seq_len``; ``None`` = the preset's), the MQAR setting (``vocab_size``, ``seq_len``, ``kv_pairs``, ``n_queries``,
    ``power_a``, ``random_fill``: :class:`lintime.evaluation.tasks.mqar.MQARConfig`), the data
    (``train_examples``, ``test_examples``, ``batch_size``: ``None`` = Zoology's for the length),
    the recipe (``epochs``, ``lr``, ``weight_decay``, ``aux_weight``, ``early_stop``: stop once
    the test accuracy exceeds it, 0 = never; ``max_steps``: an optional cap (the schedule keeps
    its length); ``eval_every``: steps between test evaluations and cosine steps, ``None`` = once
    per epoch; ``max_seconds``: a wall-clock cap), ``seed`` (the data) and ``init_seed`` (the
    initial weights; ``None`` = ``seed``), ``device``, ``precision``.
    """

    task: str = "mqar"
    preset: str = "transformer-pp-tiny"
    d_model: int | None = None
    n_layers: int | None = 2
    n_heads: int | None = None
    mlp: bool = False
    position: str | None = None
    vocab_size: int = 8192
    seq_len: int = 64
    kv_pairs: int = 4
    n_queries: int | None = None
    power_a: float = 0.01
    random_fill: bool = False
    train_examples: int = 100_000
    test_examples: int = 3_000
    batch_size: int | None = None
    epochs: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    aux_weight: float = 1e-4
    early_stop: float = 0.99
    max_steps: int | None = None
    eval_every: int | None = None
    max_seconds: float | None = None
    seed: int = 0
    init_seed: int | None = None
    device: str = "auto"
    precision: str = "auto"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        self.mqar  # validates the task setting
        if self.position not in (None, "none", "scaled_sin", "learned"):
            raise ValueError(f"position must be none, scaled_sin or learned (or None: the preset's), got {self.position!r}")
        for name in ("train_examples", "test_examples", "epochs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.mlp, bool):
            raise ValueError(f"mlp must be a bool, got {self.mlp!r}")
        for name in ("d_model", "n_layers", "n_heads", "batch_size", "max_steps", "eval_every", "init_seed"):
            v = getattr(self, name)
            low = 0 if name == "init_seed" else 1
            if v is not None and (not isinstance(v, int) or v < low):
                raise ValueError(f"{name} must be an integer >= {low} or None, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        for name in ("weight_decay", "aux_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        if self.max_seconds is not None and not (isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0):
            raise ValueError(f"max_seconds must be > 0 or None, got {self.max_seconds!r}")
        if not 0 <= self.early_stop <= 1:
            raise ValueError(f"early_stop is an accuracy in [0, 1] (0 = never), got {self.early_stop!r}")

    @property
    def mqar(self) -> MQARConfig:
        return MQARConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, kv_pairs=self.kv_pairs,
                          n_queries=self.n_queries, power_a=self.power_a, random_fill=self.random_fill)

    @property
    def rows(self) -> int:
        return min(self.batch_size or zoology_batch_size(self.seq_len), self.train_examples)

    def model_config(self):
        overrides = {"vocab_size": self.vocab_size}
        if self.d_model is not None:
            overrides["d_model"] = self.d_model
        if self.n_layers is not None:
            overrides["n_layers"] = self.n_layers
        if not self.mlp:
            overrides["ffn"] = None
        if self.position is not None:
            overrides["position"] = self.position
            overrides["max_positions"] = self.seq_len if self.position == "learned" else 0
        cfg = get_preset(self.preset, **overrides)
        if self.n_heads is not None:
            if not hasattr(cfg.mixer, "n_heads"):
                raise ValueError(f"the {cfg.family} mixer of {self.preset} has no heads to set (n_heads)")
            cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, n_heads=self.n_heads))
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TaskTrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"task train config: unknown field(s) {unknown}")
        return cls(**d)


@dataclasses.dataclass
class TaskTrainResult:
    run_dir: Path
    steps: int
    epochs: int
    accuracy: float  # test accuracy at the last evaluation
    best_accuracy: float
    seconds: float  # training wall time (without the test evaluations)
    checkpoint: Path
    stopped: str = "epochs"  # why it ended: "early stop", "epochs", "max_steps" or "max_seconds"


def cosine_lr(peak: float, epoch: int, epochs: int) -> float:
    """``CosineAnnealingLR(T_max=epochs, eta_min=0)`` at ``epoch`` (stepped once per epoch)."""
    return peak * 0.5 * (1 + math.cos(math.pi * epoch / epochs))


def schedule(cfg: TaskTrainConfig) -> tuple[int, int, int]:
    """``(steps, stage, stages)`` of a run: its length in steps (``epochs`` x the batches of an
    epoch, or ``max_steps`` when smaller), the steps between two evaluations (``eval_every``, or an
    epoch) and the cosine's length in evaluations, one cosine step per evaluation: over the
    ``epochs``, whether or not ``max_steps`` cuts the run."""
    per_epoch = cfg.train_examples // cfg.rows
    horizon = cfg.epochs * per_epoch
    steps = horizon if cfg.max_steps is None else min(horizon, cfg.max_steps)
    stage = min(cfg.eval_every or per_epoch, steps)
    return steps, stage, -(-horizon // stage)


def query_loss(model, x: torch.Tensor, y: torch.Tensor, aux_losses: dict | None = None) -> torch.Tensor:
    """The summed cross-entropy of the queried values (``y != IGNORE_INDEX``), from the hidden
    states at those positions only (:func:`lintime.evaluation.tasks.mqar.query_logits`'s rows,
    through the model's fused loss): equal to ``model(x, targets=y)``."""
    backbone_h, _ = model.backbone(x, aux_losses=aux_losses)  # [B, T, d]
    mask = y != IGNORE_INDEX
    return model._loss(backbone_h[mask], y[mask], True)


def train_task(
    config: TaskTrainConfig,
    *,
    out: str | Path = "runs",
    name: str | None = None,
    echo: Callable[[str], None] | None = print,
    plot: bool = True,
) -> TaskTrainResult:
    """Train ``config`` into ``out/name`` with the recipe of the module docstring (``plot``: draw
    ``accuracy_vs_epoch.png`` at the end)."""
    say = echo or (lambda line: None)
    started = time.perf_counter()
    cfg = config
    task = cfg.mqar
    device = pick_device(cfg.device)
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be auto, fp32 or bf16, got {cfg.precision!r}")
    amp = autocast_dtype(device, cfg.precision)
    model_cfg = cfg.model_config()
    seed_everything(cfg.seed if cfg.init_seed is None else cfg.init_seed)  # the initial weights only
    model = CausalLM(model_cfg).to(device)
    model.train()

    from lintime.data import ByteTokenizer

    run_dir = Path(out) / (name or f"{cfg.task}-{cfg.preset}-d{model_cfg.d_model}-T{cfg.seq_len}-kv{cfg.kv_pairs}")
    if (run_dir / ckpt.CONFIG_FILE).exists():
        raise ValueError(f"run folder {run_dir} already holds a run: pick another --name")
    ckpt.write_run_config(run_dir, model_config=model_cfg, objective="clm", tokenizer=ByteTokenizer(), train=cfg.to_dict())
    metrics_path = run_dir / METRICS_FILE
    metrics_path.write_text("")

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rows = cfg.rows
    n_batches = cfg.train_examples // rows  # whole batches of the fixed training set
    total, stage, stages = schedule(cfg)
    say(f"lintime train --task {cfg.task}: {cfg.preset} d_model {model_cfg.d_model} x {model_cfg.n_layers} layers "
        f"({model.num_parameters() / 1e6:.2f}M parameters), {device.type}{' bf16' if amp is not None else ' fp32'}")
    say(f"  mqar: vocab {task.vocab_size}, seq_len {task.seq_len}, {task.kv_pairs} pairs, {task.queries} queries; "
        f"{n_batches * rows:,} train / {cfg.test_examples:,} test examples, batch {rows}")
    say(f"  recipe zoology: AdamW lr {cfg.lr:g} (cosine over {stages} {'epochs' if stage == n_batches else 'evaluations'}"
        f" of {stage} steps; this run: {total} steps), weight decay {cfg.weight_decay:g}, "
        f"stop at accuracy > {cfg.early_stop:g}"
        f"{'' if cfg.max_seconds is None else f' or after {cfg.max_seconds:g} s'}; run folder {run_dir}")

    test = tuple(t.to(device) for t in mqar_examples(task, cfg.test_examples, seed=cfg.seed, split="test"))
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the training set on the device, drawn once
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    ctx = torch.autocast(device.type, dtype=amp) if amp is not None else torch.autocast(device.type, enabled=False)
    step, elapsed, acc, best, stopped = 0, 0.0, 0.0, 0.0, "epochs"
    loss_sum = torch.zeros((), device=device)  # summed on the device: no host read per step
    taken = 0
    t0 = time.perf_counter()
    while True:
        if step % stage == 0:
            lr = cosine_lr(cfg.lr, step // stage, stages)
            for group in opt.param_groups:
                group["lr"] = lr
        if not order:  # a new epoch: the fixed batches in a new order
            order = torch.randperm(n_batches, generator=gen).tolist()
        b = order.pop(0)
        if b not in batches:
            x, y = mqar_examples(task, rows, seed=cfg.seed, split="train", start=b * rows)
            batches[b] = (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        x, y = batches[b]
        aux: dict[str, torch.Tensor] = {}
        with ctx:
            ce = query_loss(model, x, y, aux)
        loss = ce / (rows * task.queries)  # every example scores `queries` values
        if aux:
            loss = loss + cfg.aux_weight * sum(v.float() for v in aux.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        taken += 1
        over_time = cfg.max_seconds is not None and time.perf_counter() - started >= cfg.max_seconds
        if step % stage and step < total and not over_time:
            continue
        elapsed += time.perf_counter() - t0
        mean_loss = float(loss_sum) / taken
        if not math.isfinite(mean_loss):
            raise ValueError(f"training diverged by step {step} (mean loss {mean_loss}); try a lower --lr")
        res = evaluate_mqar(model, task, n_examples=cfg.test_examples, seed=cfg.seed, autocast=amp, examples=test)
        acc, best = res.accuracy, max(best, res.accuracy)
        epoch = step / n_batches
        row = {"epoch": round(epoch) if step % n_batches == 0 else round(epoch, 4), "step": step,
               "time_s": round(elapsed, 3), "lr": lr, "loss": mean_loss, "val_loss": res.loss, "val_accuracy": acc}
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        say(f"epoch {row['epoch']:>6}  step {step:>6}  train loss {mean_loss:.4f}  test loss {res.loss:.4f}  accuracy {acc:.4f}")
        if cfg.early_stop and acc > cfg.early_stop:
            stopped = "early stop"
        elif over_time:
            stopped = "max_seconds"
        elif step >= total:
            stopped = "epochs" if cfg.max_steps is None or total < cfg.max_steps else "max_steps"
        else:
            loss_sum.zero_()
            taken = 0
            t0 = time.perf_counter()
            continue
        break
    epochs_done = math.ceil(step / n_batches)
    model.eval()
    state = {"format": 1, "step": step, "epoch": epochs_done, "elapsed_s": elapsed, "accuracy": acc}
    last = ckpt.save_checkpoint(run_dir, step, model, state, keep=1)
    if plot:
        plot_task_metrics(run_dir, title=f"{cfg.preset} d{model_cfg.d_model}, MQAR T={cfg.seq_len} kv={cfg.kv_pairs}")
    say(f"done ({stopped}): {step} steps ({step / n_batches:.2f} epochs) in {elapsed / 60:.1f} min; "
        f"test accuracy {acc:.4f} (best {best:.4f}); saved {last}")
    return TaskTrainResult(run_dir=run_dir, steps=step, epochs=epochs_done, accuracy=acc, best_accuracy=best,
                           seconds=elapsed, checkpoint=last, stopped=stopped)


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
