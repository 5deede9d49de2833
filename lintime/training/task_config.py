"""What decides a synthetic-task run (``lintime train --task mqar``): :class:`TaskTrainConfig`, and the
schedule it implies (:func:`schedule`, :func:`cosine_lr`; Zoology's batch sizes, :func:`zoology_batch_size`).

The recipe these settings describe, and the run that follows them, are in :mod:`lintime.training.tasks`;
the MQAR setting itself (:class:`~lintime.evaluation.tasks.mqar.MQARConfig`) and its data, loss and scoring
are in :mod:`lintime.evaluation.tasks.mqar`.
"""

from __future__ import annotations

import dataclasses
import math

from lintime.evaluation.tasks.mqar import MIX_BATCH, MQARConfig, format_mix, mix_rows, mix_unit
from lintime.models import get_preset

TASKS = ("mqar",)
GRAPH_MODES = ("auto", "capture", "eager", "off")  # the training step: see lintime.training.tasks.TaskRun


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
    ``power_a``, ``random_fill``: :class:`lintime.evaluation.tasks.mqar.MQARConfig`) or a mixture of
    points (``mix``: ``((seq_len, kv_pairs, examples), ...)``, Zoology's multi-point training,
    :class:`lintime.evaluation.tasks.mqar.MQARMixData`; then ``seq_len`` (the padded row), ``kv_pairs``
    and ``train_examples`` are derived from it: the longest length, the most pairs, the examples in
    all; the batch rows (``batch_size``, default :data:`~lintime.evaluation.tasks.mqar.MIX_BATCH` rounded to
    a multiple of :func:`~lintime.evaluation.tasks.mqar.mix_unit`) hold every point in its exact
    proportion; the test accuracy is taken at every point and the run stops early once the lowest
    passes ``early_stop``), the data
    (``train_examples``, ``test_examples``, ``batch_size``: ``None`` = Zoology's for the length),
    the recipe (``epochs``, ``lr``, ``weight_decay``, ``aux_weight``, ``early_stop``: stop once
    the test accuracy exceeds it, 0 = never; ``max_steps``: an optional cap (the schedule keeps
    its length); ``eval_every``: steps between test evaluations and cosine steps, ``None`` = once
    per epoch; ``max_seconds``: a wall-clock cap), ``seed`` (the data) and ``init_seed`` (the
    initial weights; ``None`` = ``seed``), ``device``, ``precision``, ``graph`` (the training
    step, :class:`lintime.training.tasks.TaskRun`: ``capture`` in a CUDA graph, ``eager``, ``off``; ``auto`` = ``capture``
    on CUDA, ``off`` elsewhere).
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
    mix: tuple[tuple[int, int, int], ...] | None = None
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
    graph: str = "auto"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.mix is not None:
            self._set_mix()
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
        if self.graph not in GRAPH_MODES:
            raise ValueError(f"graph must be one of {GRAPH_MODES}, got {self.graph!r}")
        if not 0 <= self.early_stop <= 1:
            raise ValueError(f"early_stop is an accuracy in [0, 1] (0 = never), got {self.early_stop!r}")

    def _set_mix(self) -> None:
        """Check ``mix`` and store it as a tuple of int triples; derive ``seq_len``, ``kv_pairs`` and
        ``train_examples`` from it."""
        try:
            mix = tuple(tuple(p) for p in self.mix)
        except TypeError:
            mix = None
        if not mix or not all(len(p) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in p)
                              for p in mix):
            raise ValueError(f"mix must be ((seq_len, kv_pairs, examples), ...) of positive integers, got {self.mix!r}")
        if len({p[:2] for p in mix}) != len(mix):
            raise ValueError(f"mix names a point twice: {format_mix(mix)}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass
        set_("mix", mix)
        set_("seq_len", max(T for T, _, _ in mix))
        set_("kv_pairs", max(n for _, n, _ in mix))
        set_("train_examples", sum(c for _, _, c in mix))
        self.points  # builds (and so checks) each point's setting
        if self.batch_size is not None:
            mix_rows(mix, self.batch_size)  # raises unless a multiple of the mix's unit
            if self.batch_size > self.train_examples:
                raise ValueError(f"batch_size {self.batch_size} is more than the mix's {self.train_examples} examples")

    @property
    def points(self) -> tuple[MQARConfig, ...]:
        """The MQAR settings trained on: the mix's points, or the one point."""
        if self.mix is None:
            return (self.mqar,)
        return tuple(MQARConfig(vocab_size=self.vocab_size, seq_len=T, kv_pairs=n, n_queries=self.n_queries,
                                power_a=self.power_a, random_fill=self.random_fill) for T, n, _ in self.mix)

    @property
    def point_examples(self) -> tuple[int, ...]:
        """Training examples of each point (:attr:`points`)."""
        return (self.train_examples,) if self.mix is None else tuple(c for _, _, c in self.mix)

    @property
    def point_rows(self) -> tuple[int, ...]:
        """Rows of each point in a batch."""
        return (self.rows,) if self.mix is None else mix_rows(self.mix, self.rows)

    @property
    def queries(self) -> int:
        """The most queries a row holds (the query loss picks this many positions per row)."""
        return max(p.queries for p in self.points)

    @property
    def batch_targets(self) -> int:
        """Queried values in a batch (the same in every batch)."""
        return sum(r * p.queries for r, p in zip(self.point_rows, self.points))

    @property
    def mqar(self) -> MQARConfig:
        return MQARConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, kv_pairs=self.kv_pairs,
                          n_queries=self.n_queries, power_a=self.power_a, random_fill=self.random_fill)

    @property
    def rows(self) -> int:
        if self.mix is not None:
            if self.batch_size is not None:
                return self.batch_size
            unit = mix_unit(self.mix)
            return min(unit * max(1, round(MIX_BATCH / unit)), self.train_examples)
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
        if d.get("mix") is not None:  # JSON keeps the triples as lists
            d = {**d, "mix": tuple(tuple(p) for p in d["mix"])}
        return cls(**d)


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
