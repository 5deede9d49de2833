"""The training config (:class:`TrainConfig`) and the seeds' optimisation recipes (:data:`RECIPES`).

A recipe is a named set of optimiser and schedule settings taken from a seed; every field can be
overridden in the :class:`TrainConfig` (``lr=1e-3`` on top of ``recipe="flash"``).
:meth:`TrainConfig.resolved` fills the overrides left at ``None`` from the recipe and the budget
default, and that resolved config is what a run stores in ``config.json``, so a run folder says
exactly how it was trained.

Batch geometry: ``tokens_per_batch`` and ``context_len`` are the first-class settings (the seeds
fix tokens per batch, e.g. 2^18, and vary the context); a batch has
``rows = tokens_per_batch / context_len`` rows, processed ``micro_batch_tokens / context_len``
rows at a time with gradient accumulation.

Warm-up is a *fraction of the schedule's horizon* (the step budget, or the time budget), so a
recipe carries over to runs of any length: the FLASH seed's 10K warm-up steps of 125K are 0.08.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lintime.utils.checks import is_int, is_number

DEFAULT_STEPS = 300  # budget when none of steps / tokens / time_minutes is given (the default run: < 4 min, 2-core CPU)
# Peak learning rate of models under SMALL_MODEL_PARAMS parameters (the *-tiny presets) when --lr is
# not given: the seeds' rates are for 100M+ models, and a tiny model's short default run learns far
# more at 3e-3 than at the FLASH recipe's 7e-4.
SMALL_MODEL_PARAMS = 1_000_000
SMALL_MODEL_LR = 3e-3
DECAYS = ("linear", "cosine", "constant")
OBJECTIVES = ("clm", "mlm")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("none", "ddp", "fsdp")
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE_MODES = ("off", "model", "graph", "auto")  # lintime.training.compile.choose_compile
PACKINGS = ("documents", "rows")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Optimiser (AdamW) and learning-rate schedule of one seed.

    ``lr``              peak learning rate;
    ``betas``, ``eps``, ``weight_decay``  AdamW (decay on matrices only: ``model.param_groups``);
    ``warmup``          linear warm-up from 0, as a fraction of the horizon;
    ``decay``           after warm-up: ``linear`` / ``cosine`` from ``lr`` to ``final_lr_ratio * lr``
                        at the end of the horizon, or ``constant``;
    ``clip``            max global gradient norm (0 = no clipping);
    ``aux_weight``      weight of the mixers' auxiliary losses (Transformer-VQ's commit loss
                        coefficient beta, seed Eq. 35);
    ``source``          where each number comes from.
    """

    name: str
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup: float
    decay: str
    final_lr_ratio: float
    clip: float
    aux_weight: float
    source: str


RECIPES: dict[str, Recipe] = {
    "flash": Recipe(
        name="flash",
        lr=7e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
        warmup=10_000 / 125_000, decay="linear", final_lr_ratio=0.0, clip=0.1, aux_weight=1e-4,
        source="FLASH seed Tables 6-7 (MLM on C4, LM on Wiki-40B / PG-19): AdamW, peak 7e-4, eps 1e-6, "
               "betas (0.9, 0.999), weight decay 0.01, 10K warm-up steps of 125K, linear decay, "
               "local gradient clipping 0.1 (applied here as global-norm clipping at 0.1)",
    ),
    "vq": Recipe(
        name="vq",
        lr=4e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=2e-4,
        warmup=10_000 / 125_000, decay="cosine", final_lr_ratio=0.1, clip=0.1, aux_weight=1e-4,
        source="Transformer-VQ seed Appendix C (AdamW runs, Enwik8 column of Table 10): peak 4e-4, "
               "betas (0.9, 0.98), eps 1e-9, gradient clip 0.1, weight decay 0.0002, 10K warm-up steps of "
               "125K, cosine decay by 10x, commit coefficient beta 1e-4",
    ),
    "gla": Recipe(
        name="gla",
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
        warmup=0.02, decay="cosine", final_lr_ratio=0.0, clip=1.0, aux_weight=1e-4,
        source="GLA seed (training details): AdamW, peak 3e-4, cosine decay; the seed gives nothing else, "
               "so betas (0.9, 0.95), eps 1e-8, weight decay 0.01, warm-up 2 %, decay to 0 and clipping "
               "at 1.0 are lintime's choices",
    ),
}


# The recipe a preset trains with when ``recipe`` is not given: its family's seed (the rest: FLASH).
FAMILY_RECIPES = {"gla": "gla", "vq": "vq"}


def family_recipe(preset: str) -> str:
    """The seed recipe of ``preset``'s family (:data:`FAMILY_RECIPES`, else ``flash``)."""
    from lintime.models import get_preset

    return FAMILY_RECIPES.get(get_preset(preset).family, "flash")


def preset_parameters(preset: str) -> int:
    """Parameters of ``preset``'s causal LM (counted on the meta device: no memory used)."""
    import torch

    from lintime.models import CausalLM, get_preset

    with torch.device("meta"):
        return CausalLM(get_preset(preset)).num_parameters()


def _field(default, help: str, flag: str | None = None):
    """A config field with its command-line help (``lintime train``'s flags are generated from these); ``flag``: the
    flag's name where it differs from the field's."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (serialised as the ``train`` entry of ``config.json``).

    Model and data: ``preset`` (a :func:`lintime.models.get_preset` name; its ``vocab_size`` is
    replaced by the tokenizer's), ``objective`` (``clm`` causal LM | ``mlm`` masked LM),
    ``corpus`` / ``tokenizer`` / ``cache_dir`` / ``text_field`` (:func:`lintime.data.prepare`),
    ``mlm_prob``.

    Batch: ``context_len`` (tokens per row), ``tokens_per_batch`` (per optimiser step, a multiple
    of ``context_len``), ``micro_batch_tokens`` (tokens per forward/backward, dividing
    ``tokens_per_batch``; ``None`` = the whole batch at once), ``packing`` (``documents``: every document is its
    own sequence, ``cu_seqlens`` per batch; ``rows``: every row is one sequence, documents in a row see the ones
    before them, as GPT-2 / nanoGPT train -- the same layout every step, which ``compile="graph"`` needs).

    Budget (training stops at the first one reached; at least one is used): ``steps``, ``tokens``
    (converted to ``ceil(tokens / tokens_per_batch)`` steps), ``time_minutes`` (wall clock, not
    counting start-up, validation and checkpoints).  The schedule's horizon is the step budget
    when there is one, else the time budget (then the schedule follows the clock and a run is
    not reproducible step for step).  None of them: ``DEFAULT_STEPS`` steps.

    Optimisation: ``recipe`` (a name in :data:`RECIPES`; ``None`` = the preset family's,
    :func:`family_recipe`) and overrides ``lr``, ``warmup``,
    ``decay``, ``final_lr_ratio``, ``weight_decay``, ``beta1``, ``beta2``, ``eps``, ``clip``,
    ``aux_weight`` (``None`` = the recipe's value).

    Running: ``seed`` (the data order, the MLM masks, and the initial weights unless ``init_seed``
    is given: then ``init_seed`` alone draws them, so runs that differ in data or context can start
    from independent draws), ``device`` (``auto`` = cuda when available), ``precision`` (``auto`` = bf16
    autocast on CUDA, fp32 on CPU), ``compile`` (``auto``, the default: the fastest of the forms below that is exact
    here; ``off``: eager steps; ``model``: ``torch.compile`` the model; ``graph``: the whole step captured in one CUDA
    graph, documents packed anew every batch included where the model plans them on the device; under FSDP2
    ``model`` compiles every block after sharding (``auto``: eager steps); see
    :func:`lintime.training.compile.choose_compile`; ``True`` / ``False`` mean ``auto`` / ``off``),
    ``fused`` (the layers' fused elementwise kernels and the fused linear + cross-entropy loss; ``False``: their
    PyTorch reference forms, to check the fused path against), ``deterministic``
    (``torch.use_deterministic_algorithms``).

    Distributed (under ``torchrun``, :mod:`lintime.training.parallel`): ``parallel`` (``none`` |
    ``ddp`` | ``fsdp``: data parallelism over the processes; ``tokens_per_batch`` stays the
    *global* batch), ``context_parallel`` (``P`` processes share every row, each holding ``T / P``
    consecutive tokens).  Neither changes the updates, so both may change on resume.

    Watching and saving (every ``*_every`` counts optimiser steps; 0 = only at the end):
    ``log_every``, ``eval_every`` / ``eval_tokens`` (validation tokens per evaluation),
    ``save_every`` / ``keep`` (checkpoints kept; 0 = all), ``tensorboard``, ``plots``.

    Final sample (causal LM only): ``sample_prompt`` (``None``: the first words of the validation split's
    first document), ``sample_tokens`` (0 = none),
    ``temperature`` (0 = greedy), ``top_k`` (0 = off).

    Fine-tuning: ``init_from`` (a run or step folder) starts from that checkpoint's weights with
    this config's data, schedule and budget (fresh optimizer, step 0); the architecture and the
    vocabulary are the checkpoint's (``preset`` and ``tokenizer`` must name them).
    """

    preset: str = _field("flash-tiny",
        "model preset (lintime.models.preset_names()); its vocabulary becomes the tokenizer's.")
    objective: str = _field("clm", 'clm (causal LM) or mlm (masked LM).')
    corpus: str = _field("stdlib",
        'stdlib (the Python standard library), a folder, a file or a glob (see docs/data.md).')
    tokenizer: str = _field("byte", 'byte, bpe:N (train an N-token BPE on the train split) or bpe:FOLDER.')
    cache_dir: str | None = _field(None, 'token cache folder (default: $LINTIME_CACHE/data/<corpus>-<tokenizer>).')
    text_field: str = _field("text", 'JSONL/parquet field holding the text.')
    mlm_prob: float = _field(0.15, 'masking probability for --objective mlm.')
    context_len: int = _field(256, 'tokens per row (sequence length).')
    tokens_per_batch: int = _field(4096, 'tokens per optimiser step (rows = tokens_per_batch / context_len).')
    micro_batch_tokens: int | None = _field(None,
        'tokens per forward/backward; smaller than tokens_per_batch means gradient accumulation.')
    packing: str = _field("documents",
        'documents (every document its own sequence: documents never see each other) or rows (every row one '
        'sequence, documents in a row see the ones before them; the same layout every step, which --compile '
        'graph needs).')
    steps: int | None = _field(None,
        f'stop after this many optimiser steps (default {DEFAULT_STEPS} when no budget is given).')
    tokens: int | None = _field(None, 'stop after this many training tokens.')
    time_minutes: float | None = _field(None, 'stop after this many minutes of training (wall clock).', flag="time")
    recipe: str | None = _field(None,
        "optimisation recipe: flash (FLASH seed Tables 6-7), vq (Transformer-VQ App. C), gla (GLA seed); "
        "default: the preset family's (gla -> gla, vq -> vq, the rest -> flash).")
    lr: float | None = _field(None, "peak learning rate (default: the recipe's).")
    warmup: float | None = _field(None, "warm-up as a fraction of the schedule (default: the recipe's).")
    decay: str | None = _field(None, "linear, cosine or constant after warm-up (default: the recipe's).")
    final_lr_ratio: float | None = _field(None,
        "learning rate at the end as a fraction of the peak (default: the recipe's).")
    weight_decay: float | None = _field(None, "AdamW weight decay on matrices (default: the recipe's).")
    beta1: float | None = _field(None, "AdamW beta1 (default: the recipe's).")
    beta2: float | None = _field(None, "AdamW beta2 (default: the recipe's).")
    eps: float | None = _field(None, "AdamW epsilon (default: the recipe's).")
    clip: float | None = _field(None, "gradient clipping by global norm, 0 = off (default: the recipe's).")
    aux_weight: float | None = _field(None,
        "weight of the mixers' auxiliary losses, e.g. VQ commitment (default: the recipe's).")
    seed: int = _field(0, 'seeds the data order and the MLM masks, and the initialisation unless --init-seed is given.')
    init_seed: int | None = _field(None,
        'seeds the initial weights alone (default: --seed), so runs that differ only in data or context can '
        'start from other draws.')
    device: str = _field("auto", 'auto (cuda when available), cpu, cuda or cuda:N.')
    precision: str = _field("auto", 'auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16.')
    compile: str = _field("auto",
        'auto (the fastest exact form here, one line says which: on CUDA the whole step in one CUDA graph, '
        'documents packed anew every batch included for the families that plan them on the device), off '
        '(eager steps), model (torch.compile the model; under --parallel fsdp every block compiled after '
        'sharding) or graph; --compile alone = auto (see docs/models.md, '
        'Compiling).')
    fused: bool = _field(True,
        "the layers' fused elementwise kernels and the fused linear + cross-entropy loss; --no-fused runs "
        "their PyTorch reference forms (to check the fused path).")
    deterministic: bool = _field(False, 'torch.use_deterministic_algorithms (slower on CUDA).')
    parallel: str = _field("none",
        'under torchrun: none, ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard); --tokens-per-batch '
        'stays the global batch (see docs/distributed.md).')
    context_parallel: int = _field(1,
        'under torchrun: split every row over this many processes (linear-time families; context_len / N a '
        'multiple of the chunk size).')
    log_every: int = _field(1, 'write a metrics row every N steps (0 = none).')
    eval_every: int = _field(50, 'validate every N steps (0 = only at the end).')
    eval_tokens: int = _field(32768, 'validation tokens per evaluation.')
    save_every: int = _field(100, 'checkpoint every N steps (0 = only at the end).')
    keep: int = _field(3, 'checkpoints to keep (0 = all).')
    tensorboard: bool = _field(False, 'also write TensorBoard events (needs the tensorboard package).')
    plots: bool = _field(True, 'write loss_vs_steps.png and loss_vs_time.png.')
    sample_prompt: str | None = _field(None,
        'prompt of the final sample (default: the first words of the first validation document).', flag="prompt")
    sample_tokens: int = _field(200, 'tokens to sample at the end (0 = no sample).')
    temperature: float = _field(0.8, 'sampling temperature (0 = greedy).')
    top_k: int = _field(0, 'sample from the k most likely tokens only (0 = all).')
    init_from: str | None = _field(None,
        "start from this run's (or step folder's) weights: same architecture and vocabulary, new data, "
        "schedule and budget.")
    def __post_init__(self):
        def fail(msg: str) -> None:
            raise ValueError(f"train config: {msg}")

        def positive_int(name: str, allow_none: bool = False, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            low = 0 if allow_zero else 1
            if not is_int(v) or v < low:
                fail(f"{name} must be an integer >= {low}, got {v!r}")

        for name in ("preset", "corpus", "tokenizer", "text_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                fail(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.packing not in PACKINGS:
            fail(f"packing must be one of {PACKINGS}, got {self.packing!r}")
        if self.objective not in OBJECTIVES:
            fail(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.recipe is not None and self.recipe not in RECIPES:
            fail(f"unknown recipe {self.recipe!r}; recipes: {', '.join(RECIPES)}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            fail(f"device must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        if self.parallel not in PARALLEL:
            fail(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        positive_int("context_parallel")
        if self.precision not in PRECISIONS:
            fail(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not is_number(self.mlm_prob, finite=True) or not 0 < self.mlm_prob < 1:
            fail(f"mlm_prob must be in (0, 1), got {self.mlm_prob!r}")
        positive_int("context_len")
        positive_int("tokens_per_batch")
        positive_int("micro_batch_tokens", allow_none=True)
        if self.tokens_per_batch % self.context_len:
            fail(f"tokens_per_batch ({self.tokens_per_batch}) must be a multiple of context_len ({self.context_len})")
        if self.micro_batch_tokens is not None:
            if self.micro_batch_tokens % self.context_len:
                fail(f"micro_batch_tokens ({self.micro_batch_tokens}) must be a multiple of context_len ({self.context_len})")
            if self.tokens_per_batch % self.micro_batch_tokens:
                fail(f"micro_batch_tokens ({self.micro_batch_tokens}) must divide tokens_per_batch ({self.tokens_per_batch})")
        positive_int("steps", allow_none=True)
        positive_int("tokens", allow_none=True)
        if self.time_minutes is not None and (not is_number(self.time_minutes, finite=True) or self.time_minutes <= 0):
            fail(f"time_minutes must be > 0, got {self.time_minutes!r}")
        if self.lr is not None and (not is_number(self.lr, finite=True) or self.lr <= 0):
            fail(f"lr must be > 0, got {self.lr!r}")
        if self.warmup is not None and (not is_number(self.warmup, finite=True) or not 0 <= self.warmup < 1):
            fail(f"warmup is a fraction of the schedule in [0, 1), got {self.warmup!r}")
        if self.decay is not None and self.decay not in DECAYS:
            fail(f"decay must be one of {DECAYS}, got {self.decay!r}")
        ratio = self.final_lr_ratio
        if ratio is not None and (not is_number(ratio, finite=True) or not 0 <= ratio <= 1):
            fail(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if v is not None and (not is_number(v, finite=True) or not 0 <= v < 1):
                fail(f"{name} must be in [0, 1), got {v!r}")
        if self.eps is not None and (not is_number(self.eps, finite=True) or self.eps <= 0):
            fail(f"eps must be > 0, got {self.eps!r}")
        for name in ("weight_decay", "clip", "aux_weight"):
            v = getattr(self, name)
            if v is not None and (not is_number(v, finite=True) or v < 0):
                fail(f"{name} must be >= 0, got {v!r}")
        if not is_int(self.seed) or self.seed < 0:
            fail(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.init_seed is not None and (not is_int(self.init_seed) or self.init_seed < 0):
            fail(f"init_seed must be an integer >= 0 or None, got {self.init_seed!r}")
        for name in ("log_every", "eval_every", "save_every", "keep", "sample_tokens", "top_k"):
            positive_int(name, allow_zero=True)
        positive_int("eval_tokens")
        if not is_number(self.temperature, finite=True) or self.temperature < 0:
            fail(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            fail(f"init_from must be a run or step folder, got {self.init_from!r}")
        if isinstance(self.compile, bool):  # the flag's older form: --compile / --no-compile
            object.__setattr__(self, "compile", "auto" if self.compile else "off")
        if self.compile not in COMPILE_MODES:
            fail(f"compile must be one of {COMPILE_MODES} (or a bool: True = auto), got {self.compile!r}")
        for name in ("fused", "deterministic", "tensorboard", "plots"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be a bool, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def rows_per_batch(self) -> int:
        """Rows (sequences of ``context_len``) per optimiser step."""
        return self.tokens_per_batch // self.context_len

    @property
    def rows_per_micro_batch(self) -> int:
        return (self.micro_batch_tokens or self.tokens_per_batch) // self.context_len

    @property
    def accumulation_steps(self) -> int:
        return self.rows_per_batch // self.rows_per_micro_batch

    @property
    def step_budget(self) -> int | None:
        """Steps to train, from ``steps`` and ``tokens`` (the smaller), or None (time only)."""
        found = []
        if self.steps is not None:
            found.append(self.steps)
        if self.tokens is not None:
            found.append(math.ceil(self.tokens / self.tokens_per_batch))
        return min(found) if found else None

    # ------------------------------------------------------------------ recipe
    def resolved(self) -> TrainConfig:
        """This config with its recipe named (the preset family's when ``None``), every ``None``
        optimiser field taken from the recipe (the peak rate: :data:`SMALL_MODEL_LR` for a model
        under :data:`SMALL_MODEL_PARAMS` parameters), and the default step budget when no budget
        is given."""
        recipe = self.recipe if self.recipe is not None else family_recipe(self.preset)
        r = RECIPES[recipe]
        lr = r.lr
        if self.lr is None and preset_parameters(self.preset) < SMALL_MODEL_PARAMS:
            lr = SMALL_MODEL_LR
        fill = {
            "lr": lr, "warmup": r.warmup, "decay": r.decay, "final_lr_ratio": r.final_lr_ratio,
            "weight_decay": r.weight_decay, "beta1": r.betas[0], "beta2": r.betas[1], "eps": r.eps,
            "clip": r.clip, "aux_weight": r.aux_weight,
        }
        changes = {k: v for k, v in fill.items() if getattr(self, k) is None}
        if self.recipe is None:
            changes["recipe"] = recipe
        if self.steps is None and self.tokens is None and self.time_minutes is None:
            changes["steps"] = DEFAULT_STEPS
        return dataclasses.replace(self, **changes) if changes else self

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        if not isinstance(d, dict):
            raise ValueError(f"train config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"train config: unknown field(s) {unknown}")
        return cls(**d)


# Settings a resumed run may change: they do not alter the sequence of updates (budgets only
# move the end, and with a step budget they also move the schedule's horizon -- see resume docs).
RESUMABLE_CHANGES = (
    "steps", "tokens", "time_minutes", "log_every", "eval_every", "eval_tokens", "save_every", "keep",
    "tensorboard", "plots", "sample_prompt", "sample_tokens", "temperature", "top_k", "device", "compile",
    "fused", "cache_dir", "parallel", "context_parallel",
)
