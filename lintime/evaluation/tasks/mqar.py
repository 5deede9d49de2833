"""Multi-query associative recall (MQAR), the synthetic recall task of the Zoology study
(Arora, Eyuboglu et al., "Zoology: Measuring and Improving Recall in Efficient Language Models",
2023; layout of ``zoology/data/multiquery_ar.py``).

One example, ``T`` = ``seq_len`` tokens, ``n`` = ``kv_pairs``, ``q`` = ``n_queries``::

    k1 v1 k2 v2 ... kn vn | . . k3 . . . k1 . ... .      inputs   [T]
     -  -  -  -  ...  -  -| - -  v3 - - -  v1 - ...  -    targets  [T]  (- = IGNORE_INDEX)

* keys are drawn without repetition from ``[1, vocab_size // 2)``, values without repetition from
  ``[vocab_size // 2, vocab_size)``: the first ``2n`` tokens are the pairs;
* the query section (``T - 2n`` tokens) holds ``q`` of the keys at even offsets ``2 g``; the
  gaps ``g`` are distinct, drawn with probability ``~ g^(a - 1)`` (``a`` = ``power_a``, 0.01:
  queries tend to follow the pairs closely, as a repeated bigram follows its first mention in
  text); the other query-section tokens are 0 (``random_fill``: uniform random tokens instead);
* the target at a query key's position is its value, nothing else is scored: the loss and the
  accuracy are on the ``q`` queried values only (a causal LM predicts the value from the key).

Zoology's Figure 2 setting: ``vocab_size`` 8192, ``power_a`` 0.01, no random fill, every key
queried, ``(seq_len, kv_pairs)`` in ``(64, 4), (128, 8), (256, 16), (512, 64)``.

Determinism: example block ``j`` of a split is drawn from ``numpy.random.default_rng([seed,
split, j])`` (:data:`BLOCK` examples per block), so any example is reproducible from its seed
alone and the train and test streams never share a generator.

Everything MQAR-specific is here: the setting (:class:`MQARConfig`), the examples
(:func:`mqar_examples`; :class:`MQARData` keeps a run's on its device), the loss on the queried
positions (:func:`query_loss`, :class:`QueryLoss`: the training loss of ``lintime train --task
mqar``), the test accuracy (:func:`evaluate_mqar`) and its table and plot.  The training recipe
that uses them is :mod:`lintime.training.tasks`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch

IGNORE_INDEX = -100  # lintime.data.IGNORE_INDEX (the loss and the accuracy skip it)
BLOCK = 256  # examples per generator block (a block is drawn whole)
SPLITS = {"train": 0, "test": 1}


@dataclasses.dataclass(frozen=True)
class MQARConfig:
    """One MQAR setting.

    ``vocab_size``   tokens (keys take the lower half, values the upper half; token 0 is the filler);
    ``seq_len``      tokens per example (even);
    ``kv_pairs``     key-value pairs per example;
    ``n_queries``    keys queried per example (``None`` = all ``kv_pairs``, Zoology's choice);
    ``power_a``      the power law of the query gaps (1.0 = uniform);
    ``random_fill``  non-query tokens of the query section uniform random instead of 0
                     (Zoology's ``random_non_queries``; its Figure 2 runs use 0).
    """

    vocab_size: int = 8192
    seq_len: int = 64
    kv_pairs: int = 4
    n_queries: int | None = None
    power_a: float = 0.01
    random_fill: bool = False

    def __post_init__(self):
        def fail(msg: str) -> None:
            raise ValueError(f"mqar: {msg}")

        for name in ("vocab_size", "seq_len", "kv_pairs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                fail(f"{name} must be a positive integer, got {v!r}")
        if self.seq_len % 2:
            fail(f"seq_len must be even (queries sit at even offsets), got {self.seq_len}")
        if self.kv_pairs >= self.vocab_size // 2:
            fail(f"{self.kv_pairs} distinct keys need vocab_size > {2 * (self.kv_pairs + 1)}, got {self.vocab_size}")
        if 4 * self.kv_pairs > self.seq_len:
            fail(f"{self.kv_pairs} pairs and their queries need seq_len >= {4 * self.kv_pairs}, got {self.seq_len}")
        if self.n_queries is not None and not (isinstance(self.n_queries, int) and 1 <= self.n_queries <= self.kv_pairs):
            fail(f"n_queries must be in [1, kv_pairs={self.kv_pairs}] or None, got {self.n_queries!r}")
        if not isinstance(self.power_a, (int, float)) or not 0 < self.power_a <= 1:
            fail(f"power_a must be in (0, 1], got {self.power_a!r}")
        if not isinstance(self.random_fill, bool):
            fail(f"random_fill must be a bool, got {self.random_fill!r}")

    @property
    def queries(self) -> int:
        return self.kv_pairs if self.n_queries is None else self.n_queries

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MQARConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _distinct(rng: np.random.Generator, rows: int, k: int, low: int, high: int) -> np.ndarray:
    """``[rows, k]`` integers in ``[low, high)``, distinct within each row, uniform over such rows
    (rows with a repeat are drawn again)."""
    out = rng.integers(low, high, size=(rows, k))
    while True:
        s = np.sort(out, axis=1)
        bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0]
        if bad.size == 0:
            return out
        out[bad] = rng.integers(low, high, size=(bad.size, k))


def _block(cfg: MQARConfig, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
    n, q, T = cfg.kv_pairs, cfg.queries, cfg.seq_len
    half = cfg.vocab_size // 2
    keys = _distinct(rng, rows, n, 1, half)  # [rows, n]
    values = _distinct(rng, rows, n, half, cfg.vocab_size)  # [rows, n]
    space = (T - 2 * n) // 2  # query slots
    # q distinct gaps with P(g) ~ (g + 1)^(a - 1), sampled without replacement (Gumbel top-k)
    logp = (cfg.power_a - 1.0) * np.log(np.arange(1, space + 1))
    scores = logp[None, :] + rng.gumbel(size=(rows, space))
    gaps = np.argpartition(-scores, q - 1, axis=1)[:, :q]  # [rows, q]
    which = np.argsort(rng.random((rows, n)), axis=1)[:, :q]  # the queried pairs, [rows, q]
    qkeys = np.take_along_axis(keys, which, 1)
    qvalues = np.take_along_axis(values, which, 1)

    inputs = np.zeros((rows, T), dtype=np.int64)
    inputs[:, 0 : 2 * n : 2] = keys
    inputs[:, 1 : 2 * n : 2] = values
    if cfg.random_fill:
        inputs[:, 2 * n :] = rng.integers(0, cfg.vocab_size, size=(rows, T - 2 * n))
    pos = 2 * n + 2 * gaps  # [rows, q] positions of the query keys
    np.put_along_axis(inputs, pos, qkeys, 1)
    targets = np.full((rows, T), IGNORE_INDEX, dtype=np.int64)
    np.put_along_axis(targets, pos, qvalues, 1)
    return inputs, targets


def mqar_examples(cfg: MQARConfig, n: int, *, seed: int = 0, split: str = "train", start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples ``start .. start + n - 1`` of the ``split`` stream (``train`` / ``test``) of seed
    ``seed``: ``(inputs, targets)``, both ``[n, seq_len]`` int64 (module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    if n < 1 or start < 0:
        raise ValueError(f"need n >= 1 and start >= 0, got n={n}, start={start}")
    first, last = start // BLOCK, (start + n - 1) // BLOCK
    parts = [_block(cfg, np.random.default_rng([seed, SPLITS[split], j]), BLOCK) for j in range(first, last + 1)]
    inputs = np.concatenate([p[0] for p in parts])[start - first * BLOCK :][:n]
    targets = np.concatenate([p[1] for p in parts])[start - first * BLOCK :][:n]
    return torch.from_numpy(inputs), torch.from_numpy(targets)


@dataclasses.dataclass
class MQARResult:
    """Accuracy on the queried values of ``n_examples`` test examples."""

    config: dict
    n_examples: int
    n_queries: int
    accuracy: float
    loss: float  # mean cross-entropy per queried value (nats)
    seconds: float
    skipped: str | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def query_logits(model, inputs: torch.Tensor, mask: torch.Tensor, *, aux_losses: dict | None = None) -> torch.Tensor:
    """``[Q, V]`` logits at the ``Q`` positions where ``mask [B, T]`` is set: the backbone's hidden
    states at those positions through the output projection alone (an MQAR example scores
    ``kv_pairs`` of its ``seq_len`` positions; the other logits would be computed and thrown
    away).  A model without a ``backbone`` (a test double) is run whole and its logits picked."""
    backbone = getattr(model, "backbone", None)
    if backbone is None:
        return model(inputs)[mask]
    h, _ = backbone(inputs, aux_losses=aux_losses)  # [B, T, d]
    return model._logits(h[mask])  # [Q, V]


@torch.no_grad()
def query_scores(model, inputs: torch.Tensor, targets: torch.Tensor, *, autocast: torch.dtype | None = None) -> tuple[int, float, int]:
    """``(correct, summed cross-entropy, queries)`` of one batch: the argmax of the logits at
    every position with a target, against it."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else torch.autocast(device.type, enabled=False)
    mask = targets != IGNORE_INDEX
    with ctx:
        picked = query_logits(model, inputs, mask).float()  # [Q, V]
    wanted = targets[mask]
    correct = int((picked.argmax(-1) == wanted).sum())
    return correct, float(F.cross_entropy(picked, wanted, reduction="sum")), int(wanted.numel())


def evaluate_mqar(
    model,
    cfg: MQARConfig,
    *,
    n_examples: int = 3000,
    seed: int = 0,
    batch_size: int | None = None,
    autocast: torch.dtype | None = None,
    examples: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> MQARResult:
    """Accuracy of ``model`` on the first ``n_examples`` of the test stream of ``seed``.

    ``batch_size``: examples per forward (default: as many as keep the largest activation near
    2^25 values on a CPU, 2^29 on a GPU: 1 GiB in bf16).  ``examples``: those test examples already drawn
    (``mqar_examples(cfg, n_examples, seed=seed, split="test")``, on any device: a trainer that
    scores often keeps them on its device).
    A learned position table shorter than ``seq_len`` or a vocabulary smaller than the task's
    is reported as skipped."""
    vocab = model.config.vocab_size
    if vocab < cfg.vocab_size:
        return MQARResult(cfg.to_dict(), 0, 0, math.nan, math.nan, 0.0,
                          skipped=f"the model has {vocab} token ids, the task needs {cfg.vocab_size}")
    if getattr(model.config, "position", None) == "learned" and model.config.max_positions < cfg.seq_len:
        return MQARResult(cfg.to_dict(), 0, 0, math.nan, math.nan, 0.0,
                          skipped=f"longer than the model's learned position table ({model.config.max_positions})")
    if examples is not None:
        if examples[0].shape != (n_examples, cfg.seq_len) or examples[1].shape != examples[0].shape:
            raise ValueError(f"examples must be two [{n_examples}, {cfg.seq_len}] tensors, "
                             f"got {tuple(examples[0].shape)} and {tuple(examples[1].shape)}")
    if batch_size is None:
        cuda = next(model.parameters()).device.type == "cuda"
        # per example: the blocks' widest activations (~8 d per position), a head's attention
        # scores (T^2) or the queried logits, whichever is largest
        width = 8 * getattr(model.config, "d_model", vocab)
        per_example = max(cfg.seq_len * width, cfg.seq_len**2, cfg.queries * vocab)
        batch_size = max(1, (2**29 if cuda else 2**25) // per_example)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    correct = queries = 0
    nll = 0.0
    try:
        for start in range(0, n_examples, batch_size):
            n = min(batch_size, n_examples - start)
            if examples is None:
                x, y = mqar_examples(cfg, n, seed=seed, split="test", start=start)
            else:
                x, y = examples[0][start : start + n], examples[1][start : start + n]
            c, s, q = query_scores(model, x, y, autocast=autocast)
            correct, nll, queries = correct + c, nll + s, queries + q
    finally:
        model.train(was_training)
    return MQARResult(cfg.to_dict(), n_examples, queries, correct / queries, nll / queries, time.perf_counter() - t0)


def format_mqar(results: list[MQARResult]) -> str:
    """The results as a text table, one row per setting."""
    from lintime.evaluation.tasks.report import table

    rows = []
    for r in results:
        c = r.config
        head = [str(c["seq_len"]), str(c["kv_pairs"]), str(c["n_queries"] or c["kv_pairs"]), str(c["vocab_size"])]
        if r.skipped:
            rows.append(head + [f"skipped: {r.skipped}"])
        else:
            rows.append(head + [f"{r.accuracy:.4f}", f"{r.loss:.4f}", f"{r.n_queries:,}"])
    return table(["seq_len", "kv_pairs", "queries", "vocab", "accuracy", "loss", "scored"], rows)


def plot_mqar(results: list[MQARResult], path, *, title: str = "") -> None:
    """Accuracy against the number of key-value pairs, one line per sequence length."""
    from lintime.evaluation.tasks.report import figure

    done = [r for r in results if not r.skipped]
    with figure(path, title or "MQAR accuracy", "key-value pairs", "accuracy on queried values") as ax:
        for T in sorted({r.config["seq_len"] for r in done}):
            pts = sorted((r.config["kv_pairs"], r.accuracy) for r in done if r.config["seq_len"] == T)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"seq_len {T}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)


def query_loss(model, x: torch.Tensor, y: torch.Tensor, aux_losses: dict | None = None, *,
               queries: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of the queried values (``y != IGNORE_INDEX``), from the hidden
    states at those positions only (:func:`query_logits`'s rows, through the model's fused loss):
    equal to ``model(x, targets=y)``; the training loss of an MQAR run.

    ``queries``: at most this many targets per row (MQAR's ``n_queries``); the positions are then
    picked with fixed shapes (``[B, queries]``, the targets' positions in order, as the mask picks
    them), so the step has no host read and a CUDA graph can hold it.  ``None``: picked by the
    mask (one host read for the count)."""
    backbone_h, _ = model.backbone(x, aux_losses=aux_losses)  # [B, T, d]
    mask = y != IGNORE_INDEX
    if queries is None:
        return model._loss(backbone_h[mask], y[mask], True)
    T = y.shape[1]
    # the first `queries` target positions of each row, in order (a row with fewer targets picks
    # positions without one, whose IGNORE_INDEX targets add nothing)
    score = mask * torch.arange(T, 0, -1, device=y.device)  # [B, T]: T - t at targets, 0 elsewhere
    pos = score.topk(min(queries, T), dim=1).indices  # [B, Q]
    h = backbone_h.gather(1, pos.unsqueeze(-1).expand(-1, -1, backbone_h.shape[-1]))  # [B, Q, d]
    return model._loss(h.flatten(0, 1), y.gather(1, pos).flatten(), True)


class QueryLoss(torch.nn.Module):
    """``model`` with :func:`query_loss` (fixed shapes) as its loss, in the call form of a training
    step on rows (``forward(ids, aux_losses=, targets=, fused_loss=)`` -> the summed cross-entropy:
    :class:`lintime.training.graphed.GraphedStep`, :func:`lintime.training.step.forward_backward`
    with ``packed=False``)."""

    def __init__(self, model, queries: int):
        super().__init__()
        self.model, self.queries = model, queries

    def forward(self, ids, aux_losses=None, targets=None, fused_loss=True):
        return query_loss(self.model, ids, targets, aux_losses, queries=self.queries)


class MQARData:
    """The examples of one MQAR setting on one device: the fixed training set, drawn block by block
    as its batches are first used (a block of :data:`BLOCK` examples is drawn whole), and the test
    set.  Every run with the same :attr:`key` (task, seed, set sizes, device) trains on the same
    batches, so a sweep shares one of these between its runs (drawing a batch costs the host more
    than a graph step of a narrow model)."""

    def __init__(self, task: MQARConfig, *, seed: int, train_examples: int, test_examples: int,
                 device: torch.device):
        self.task, self.seed, self.device = task, seed, torch.device(device)
        self.train_examples, self.test_examples = train_examples, test_examples
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._test: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def key(self) -> tuple:
        """What decides the examples: equal for every run that can share them (:meth:`key_of`)."""
        return (self.task, self.seed, self.train_examples, self.test_examples, str(self.device))

    @staticmethod
    def key_of(cfg, device) -> tuple:
        """The :attr:`key` a run needs: ``cfg`` is its config (its ``mqar``, ``seed``, ``train_examples`` and
        ``test_examples``: :class:`lintime.training.task_config.TaskTrainConfig`)."""
        return (cfg.mqar, cfg.seed, cfg.train_examples, cfg.test_examples, str(torch.device(device)))

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = x.to(self.device), y.to(self.device)
        if self.device.type == "cuda":  # runs on other CUDA streams read them next: the copies must be done
            torch.cuda.current_stream(self.device).synchronize()
        return x, y

    def _block(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if j not in self._blocks:
            self._blocks[j] = self._to_device(*mqar_examples(self.task, BLOCK, seed=self.seed, split="train",
                                                             start=j * BLOCK))
        return self._blocks[j]

    def batch(self, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training examples ``start .. start + rows - 1`` (``[rows, seq_len]`` each, on the device)."""
        first, last = start // BLOCK, (start + rows - 1) // BLOCK
        parts = [self._block(j) for j in range(first, last + 1)]
        off = start - first * BLOCK
        if len(parts) == 1:
            return parts[0][0][off:off + rows], parts[0][1][off:off + rows]
        return tuple(torch.cat([p[i] for p in parts])[off:off + rows] for i in (0, 1))

    @property
    def test(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._test is None:
            self._test = self._to_device(*mqar_examples(self.task, self.test_examples, seed=self.seed, split="test"))
        return self._test


# --- a mixture of points (Zoology's multi-point training) -----------------------------------------

# Zoology's training mixture (HazyResearch/zoology, the Based paper's MQAR sweep,
# ``zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py``): (seq_len, kv_pairs, examples)
ZOOLOGY_MIX = ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000))
MIX_BATCH = 256  # Zoology's batch rows for the mixture (the rows are padded to the longest length)


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"64x4,512x128"`` (or ``64/4``) -> ``[(64, 4), (512, 128)]``: (seq_len, kv_pairs) points, repeats dropped."""
    out = []
    for part in text.split(","):
        part = part.strip().lower().replace("/", "x")
        a, sep, b = part.partition("x")
        if not (sep and a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
            raise ValueError(f"MQAR points are LENxPAIRS separated by commas (e.g. 64x4,512x128), got {text!r}")
        out.append((int(a), int(b)))
    return list(dict.fromkeys(out))


def parse_mix(text: str, examples: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """A training mixture from its text: ``zoology`` (:data:`ZOOLOGY_MIX`), or ``LENxPAIRS:EXAMPLES,...``
    (every point with its count), or ``LENxPAIRS,...`` with ``examples`` split equally between the points
    (each gets ``examples // points``).  -> ``((seq_len, kv_pairs, examples), ...)``."""
    if text.strip().lower() == "zoology":
        return ZOOLOGY_MIX
    parts = [p.strip() for p in text.split(",") if p.strip()]
    counted = [":" in p for p in parts]
    if not parts or (any(counted) and not all(counted)):
        raise ValueError(f"a mix is 'zoology', LENxPAIRS,... or LENxPAIRS:EXAMPLES,... (all points with a count or "
                         f"none), got {text!r}")
    points = [parse_points(p.partition(":")[0])[0] for p in parts]
    if len(set(points)) != len(points):
        raise ValueError(f"a mix names each point once, got {text!r}")
    if all(counted):
        counts = [p.partition(":")[2].strip() for p in parts]
        if not all(c.isdigit() and int(c) > 0 for c in counts):
            raise ValueError(f"a mix's example counts are positive integers, got {text!r}")
        return tuple((T, n, int(c)) for (T, n), c in zip(points, counts))
    if examples is None or examples // len(points) < 1:
        raise ValueError(f"a mix without counts splits the training examples between its points: {examples!r} "
                         f"examples for {len(points)} points")
    return tuple((T, n, examples // len(points)) for T, n in points)


def format_mix(mix) -> str:
    """The text :func:`parse_mix` reads back: ``64x4:100000,128x8:20000``."""
    return ",".join(f"{T}x{n}:{c}" for T, n, c in mix)


def mix_unit(mix) -> int:
    """The fewest rows a batch of the mixture can have with every point in its exact proportion
    (the counts divided by their greatest common divisor, summed): batch rows are a multiple of it."""
    g = math.gcd(*(c for _, _, c in mix))
    return sum(c // g for _, _, c in mix)


def mix_rows(mix, rows: int) -> tuple[int, ...]:
    """Rows of each point in a batch of ``rows`` (a multiple of :func:`mix_unit`): ``rows x count / total``."""
    total, unit = sum(c for _, _, c in mix), mix_unit(mix)
    if rows % unit:
        raise ValueError(f"a batch of this mix holds a multiple of {unit} rows (its points' proportions), got {rows}")
    return tuple(rows * c // total for _, _, c in mix)


def pad_rows(x: torch.Tensor, y: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded on the right to ``length`` tokens: inputs with the filler 0, targets with
    :data:`IGNORE_INDEX` (a causal model's positions before the padding do not see it, and no
    padded position is scored)."""
    import torch.nn.functional as F

    extra = length - x.shape[1]
    if extra == 0:
        return x, y
    return F.pad(x, (0, extra), value=0), F.pad(y, (0, extra), value=IGNORE_INDEX)


class MQARMixData:
    """The examples of a training mixture on one device (:class:`MQARData`'s interface): one
    :class:`MQARData` per point (its fixed training set of ``count`` examples, its test set of
    ``test_examples``, all from the stream of ``seed``), and batches of ``rows`` rows in which every
    point has its exact share (:func:`mix_rows`), each point's rows padded (:func:`pad_rows`) to the
    longest point, the points in the mixture's order.  Batch ``b`` holds examples
    ``b x share .. (b + 1) x share - 1`` of each point, so an epoch of ``total // rows`` batches uses
    each point's examples at most once."""

    def __init__(self, points: tuple[MQARConfig, ...], counts: tuple[int, ...], *, seed: int, rows: int,
                 test_examples: int, device: torch.device):
        if len(points) != len(counts) or not points:
            raise ValueError("a mix needs one count per point")
        self.points, self.counts, self.seed, self.rows = tuple(points), tuple(counts), seed, rows
        self.test_examples, self.device = test_examples, torch.device(device)
        mix = tuple((p.seq_len, p.kv_pairs, c) for p, c in zip(points, counts))
        self.shares = mix_rows(mix, rows)
        self.length = max(p.seq_len for p in points)
        self.parts = [MQARData(p, seed=seed, train_examples=c, test_examples=test_examples, device=self.device)
                      for p, c in zip(points, counts)]

    @property
    def key(self) -> tuple:
        return ("mix", self.points, self.counts, self.seed, self.rows, self.test_examples, str(self.device))

    @staticmethod
    def key_of(cfg, device) -> tuple:
        return ("mix", cfg.points, cfg.point_examples, cfg.seed, cfg.rows, cfg.test_examples, str(torch.device(device)))

    def batch(self, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``start // rows`` (``start`` is a multiple of ``rows``, which must be the mixture's
        ``rows``): ``[rows, length]`` inputs and targets, on the device."""
        if rows != self.rows or start % rows:
            raise ValueError(f"a mix's batches are whole batches of {self.rows} rows, got start {start}, rows {rows}")
        b = start // rows
        xs, ys = [], []
        for part, share in zip(self.parts, self.shares):
            x, y = pad_rows(*part.batch(b * share, share), self.length)
            xs.append(x)
            ys.append(y)
        return torch.cat(xs), torch.cat(ys)

    @property
    def test(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each point's test examples (unpadded), in the mixture's order."""
        return [part.test for part in self.parts]


def task_data(cfg, device) -> MQARData | MQARMixData:
    """The examples a task run of ``cfg`` (:class:`lintime.training.task_config.TaskTrainConfig`) trains on."""
    if cfg.mix is None:
        return MQARData(cfg.mqar, seed=cfg.seed, train_examples=cfg.train_examples, test_examples=cfg.test_examples,
                        device=device)
    return MQARMixData(cfg.points, cfg.point_examples, seed=cfg.seed, rows=cfg.rows, test_examples=cfg.test_examples,
                       device=device)


def data_key(cfg, device) -> tuple:
    """The key of :func:`task_data`'s examples for ``cfg``."""
    return MQARData.key_of(cfg, device) if cfg.mix is None else MQARMixData.key_of(cfg, device)
