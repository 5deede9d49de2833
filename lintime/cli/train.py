"""``lintime train``: the flags are :class:`lintime.training.TrainConfig`'s fields (see docs/cli.md)."""

from __future__ import annotations

import dataclasses
import inspect
import sys

from lintime.cli import CLIError, Stopped, check_writable, command, set_threads
from lintime.training.config import TrainConfig

_D = TrainConfig()  # the defaults live in one place: the config dataclass
# flag name -> TrainConfig field, where they differ
_FIELD = {"time": "time_minutes", "prompt": "sample_prompt"}
_TASK_FLAGS = ("task", "kv_pairs", "task_vocab", "d_model", "n_layers", "n_heads", "position", "examples", "epochs")
_NOT_CONFIG = ("out", "name", "resume", "progress", "threads", "_given") + _TASK_FLAGS


@command
def train(
    preset: str = _D.preset,
    objective: str = _D.objective,
    corpus: str = _D.corpus,
    tokenizer: str = _D.tokenizer,
    cache_dir: str | None = None,
    text_field: str = _D.text_field,
    context_len: int = _D.context_len,
    tokens_per_batch: int = _D.tokens_per_batch,
    micro_batch_tokens: int | None = None,
    packing: str = _D.packing,
    steps: int | None = None,
    tokens: int | None = None,
    time: float | None = None,
    recipe: str | None = _D.recipe,
    lr: float | None = None,
    warmup: float | None = None,
    decay: str | None = None,
    final_lr_ratio: float | None = None,
    weight_decay: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    clip: float | None = None,
    aux_weight: float | None = None,
    mlm_prob: float = _D.mlm_prob,
    seed: int = _D.seed,
    init_seed: int | None = _D.init_seed,
    device: str = _D.device,
    precision: str = _D.precision,
    compile: bool | str = _D.compile,
    fused: bool = _D.fused,
    deterministic: bool = _D.deterministic,
    parallel: str = _D.parallel,
    context_parallel: int = _D.context_parallel,
    log_every: int = _D.log_every,
    eval_every: int = _D.eval_every,
    eval_tokens: int = _D.eval_tokens,
    save_every: int = _D.save_every,
    keep: int = _D.keep,
    tensorboard: bool = _D.tensorboard,
    plots: bool = _D.plots,
    prompt: str | None = _D.sample_prompt,
    sample_tokens: int = _D.sample_tokens,
    temperature: float = _D.temperature,
    top_k: int = _D.top_k,
    init_from: str | None = _D.init_from,
    out: str = "runs",
    name: str | None = None,
    resume: str | None = None,
    progress: bool = True,
    threads: int = 0,
    task: str = "lm",
    kv_pairs: int = 4,
    task_vocab: int = 8192,
    d_model: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    position: str | None = None,
    examples: int = 100_000,
    epochs: int = 64,
    _given: frozenset[str] | None = None,
) -> None:
    """Train a language model with a seed's recipe; with no arguments, a tiny FLASH on the Python
    standard library (byte tokenizer), a few minutes on a laptop CPU.

    Leaves runs/<name>/ with config.json, tokenizer/, checkpoints/, metrics.jsonl/.csv, loss plots
    and sample.txt.  Ctrl-C (or SIGTERM) saves a checkpoint and stops; continue with --resume
    runs/<name> (same settings: a given flag that differs from the run's is refused, except budgets,
    logging, saving, sampling and device flags).  --init-from RUN starts from a trained model's
    weights with new data, schedule and budget (fine-tuning).

    Args:
        preset: model preset (lintime.models.preset_names()); its vocabulary becomes the tokenizer's.
        objective: clm (causal LM) or mlm (masked LM).
        corpus: stdlib (the Python standard library), a folder, a file or a glob (see docs/data.md).
        tokenizer: byte, bpe:N (train an N-token BPE on the train split) or bpe:FOLDER.
        cache_dir: token cache folder (default: $LINTIME_CACHE/data/<corpus>-<tokenizer>).
        text_field: JSONL/parquet field holding the text.
        context_len: tokens per row (sequence length).
        tokens_per_batch: tokens per optimiser step (rows = tokens_per_batch / context_len).
        micro_batch_tokens: tokens per forward/backward; smaller than tokens_per_batch means gradient accumulation.
        packing: documents (every document its own sequence: documents never see each other) or rows (every row one sequence, documents in a row see the ones before them; the same layout every step, which --compile graph needs).
        steps: stop after this many optimiser steps (default 300 when no budget is given).
        tokens: stop after this many training tokens.
        time: stop after this many minutes of training (wall clock).
        recipe: optimisation recipe: flash (FLASH seed Tables 6-7), vq (Transformer-VQ App. C), gla (GLA seed); default: the preset family's (gla -> gla, vq -> vq, the rest -> flash).
        lr: peak learning rate (default: the recipe's).
        warmup: warm-up as a fraction of the schedule (default: the recipe's).
        decay: linear, cosine or constant after warm-up (default: the recipe's).
        final_lr_ratio: learning rate at the end as a fraction of the peak (default: the recipe's).
        weight_decay: AdamW weight decay on matrices (default: the recipe's).
        beta1: AdamW beta1 (default: the recipe's).
        beta2: AdamW beta2 (default: the recipe's).
        eps: AdamW epsilon (default: the recipe's).
        clip: gradient clipping by global norm, 0 = off (default: the recipe's).
        aux_weight: weight of the mixers' auxiliary losses, e.g. VQ commitment (default: the recipe's).
        mlm_prob: masking probability for --objective mlm.
        seed: seeds the data order and the MLM masks, and the initialisation unless --init-seed is given.
        init_seed: seeds the initial weights alone (default: --seed), so runs that differ only in data or context can start from other draws.
        device: auto (cuda when available), cpu, cuda or cuda:N.
        precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16.
        compile: auto (the fastest exact form here, one line says which: on CUDA the whole step in one CUDA graph, documents packed anew every batch included for the families that plan them on the device), off (eager steps), model (torch.compile the model) or graph; --compile alone = auto (see docs/models.md, Compiling).
        fused: the layers' fused elementwise kernels and the fused linear + cross-entropy loss; --no-fused runs their PyTorch reference forms (to check the fused path).
        deterministic: torch.use_deterministic_algorithms (slower on CUDA).
        parallel: under torchrun: none, ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard); --tokens-per-batch stays the global batch (see docs/distributed.md).
        context_parallel: under torchrun: split every row over this many processes (linear-time families; context_len / N a multiple of the chunk size).
        log_every: write a metrics row every N steps (0 = none).
        eval_every: validate every N steps (0 = only at the end).
        eval_tokens: validation tokens per evaluation.
        save_every: checkpoint every N steps (0 = only at the end).
        keep: checkpoints to keep (0 = all).
        tensorboard: also write TensorBoard events (needs the tensorboard package).
        plots: write loss_vs_steps.png and loss_vs_time.png.
        prompt: prompt of the final sample (default: the first words of the first validation document).
        sample_tokens: tokens to sample at the end (0 = no sample).
        temperature: sampling temperature (0 = greedy).
        top_k: sample from the k most likely tokens only (0 = all).
        init_from: start from this run's (or step folder's) weights: same architecture and vocabulary, new data, schedule and budget.
        out: folder that holds the runs.
        name: run name (default: <preset>-<date>-<time>).
        resume: continue the run in this run folder (or from this step folder).
        progress: show the progress bar (on a terminal; elsewhere a line every 30 seconds).
        threads: CPU threads for PyTorch's intra-op work (0 = auto: 1 for models under 20M parameters, else PyTorch's default).
        task: lm (language modelling on --corpus) or mqar (Zoology's associative recall, Zoology's recipe: see docs/results_recall.md); with mqar, --context-len is the sequence length (default 64), --tokens-per-batch / --context-len the batch rows (default Zoology's), --lr the peak rate (default 1e-3), --steps a cap.
        kv_pairs: mqar: key-value pairs per example.
        task_vocab: mqar: vocabulary of the task (and of the model).
        d_model: mqar: model width (default: the preset's).
        n_layers: mqar: blocks (default 2, Zoology's; 0 = the preset's).
        n_heads: mqar: heads of the mixer (default: the preset's; Zoology's attention has 1).
        position: mqar: absolute positions none, scaled_sin or learned (default: the preset's).
        examples: mqar: training examples (a fixed set, seen once per epoch).
        epochs: mqar: epochs (the cosine schedule's length; training stops early once the test accuracy passes 0.99).
    """
    if task != "lm":
        given_flags = set(_given) if _given is not None else {k for k, v in locals().items() if k in _TASK_ARGS and v != _TASK_ARGS[k]}
        return _train_task(task, {k: v for k, v in locals().items() if k in _TASK_ARGS}, given_flags)
    if _given is not None and set(_given) & set(_TASK_FLAGS):
        raise CLIError(f"{', '.join('--' + k.replace('_', '-') for k in sorted(set(_given) & set(_TASK_FLAGS)))} "
                       "apply to --task mqar only")
    fields = {_FIELD.get(k, k): v for k, v in locals().items() if k not in _NOT_CONFIG}
    from lintime.training.trainer import train as run_training

    given = _given_fields(fields, _given)
    if resume is not None:
        config = _resume_config(resume, fields, given)
    else:
        if init_from is not None:
            fields = _init_from_defaults(init_from, fields, given)
        config = TrainConfig(**fields)
        run = f"{out}/{name}" if name is not None else out
        check_writable(run, "--out" if name is None else "--out / --name")
    if config.cache_dir is not None:
        check_writable(config.cache_dir, "--cache-dir", ok_if=lambda p: (p / "train.json").is_file())
    set_threads(threads, device=config.device, n_params=_n_params(config))
    try:
        result = run_training(config, out=out, name=name, resume=resume, progress=progress, echo=_Echo())
    except RuntimeError as err:
        if "out of memory" in str(err).lower():
            raise CLIError(f"out of memory: lower --micro-batch-tokens or --context-len ({str(err).splitlines()[0]})") from None
        raise
    if result.stopped_by is not None:
        import signal

        where = f"checkpoint {result.checkpoint}" if result.checkpoint is not None else "no checkpoint (no step taken)"
        raise Stopped(f"stopped by {result.stopped_by} at step {result.step}: {where}; "
                      f"continue with: lintime train --resume {result.run_dir}",
                      exit_code=128 + getattr(signal, result.stopped_by))


# flags that --task mqar reads, with their defaults; any other given flag is refused
_TASK_ARGS = {"preset": _D.preset, "context_len": _D.context_len, "tokens_per_batch": _D.tokens_per_batch, "steps": None,
              "lr": None, "weight_decay": None, "seed": _D.seed, "init_seed": None, "device": _D.device,
              "precision": _D.precision, "out": "runs", "name": None, "progress": True, "threads": 0, "task": "lm",
              "kv_pairs": 4, "task_vocab": 8192, "d_model": None, "n_layers": None, "n_heads": None, "position": None, "examples": 100_000,
              "epochs": 64}


def _train_task(task: str, args: dict, given: set[str]) -> None:
    """``lintime train --task mqar``: :func:`lintime.training.tasks.train_task` with the flags that
    apply to it (Zoology's sequence length 64, rate 1e-3, batch rows and 2 layers by default)."""
    from lintime.training.tasks import TASKS, TaskTrainConfig, train_task

    if task not in TASKS:
        raise CLIError(f"--task must be lm or one of {', '.join(TASKS)}, got {task!r}")
    other = sorted(k for k in given if k not in _TASK_ARGS and not k.startswith("_"))
    if other:
        raise CLIError(f"--task {task} does not use {', '.join('--' + k.replace('_', '-') for k in other)}")
    seq_len = args["context_len"] if "context_len" in given else 64
    rows = args["tokens_per_batch"] // seq_len if "tokens_per_batch" in given else None
    if rows == 0:
        raise CLIError(f"--tokens-per-batch {args['tokens_per_batch']} is less than one row of {seq_len} tokens")
    try:
        cfg = TaskTrainConfig(
            task=task, preset=args["preset"], d_model=args["d_model"],
            n_layers=2 if args["n_layers"] is None else (args["n_layers"] or None), n_heads=args["n_heads"],
            position=args["position"],
            vocab_size=args["task_vocab"], seq_len=seq_len, kv_pairs=args["kv_pairs"], train_examples=args["examples"],
            batch_size=rows, epochs=args["epochs"], lr=args["lr"] if args["lr"] is not None else 1e-3,
            weight_decay=args["weight_decay"] if args["weight_decay"] is not None else 0.1, max_steps=args["steps"],
            seed=args["seed"], init_seed=args["init_seed"], device=args["device"], precision=args["precision"],
        )
        n_params = _task_params(cfg)
    except (TypeError, ValueError) as err:
        raise CLIError(str(err)) from None
    out, name = args["out"], args["name"]
    check_writable(f"{out}/{name}" if name is not None else out, "--out" if name is None else "--out / --name")
    set_threads(args["threads"], device=cfg.device, n_params=n_params)
    result = train_task(cfg, out=out, name=name, echo=_Echo(), progress=args["progress"])
    if result.stopped_by is not None:
        import signal

        where = (f"checkpoint {result.checkpoint} (test accuracy {result.accuracy:.4f})"
                 if result.checkpoint is not None else "no checkpoint (no step taken)")
        score = (f"; score it with: lintime eval {result.run_dir} --task {task}" if result.checkpoint is not None
                 else "")
        raise Stopped(f"stopped by {result.stopped_by} at step {result.steps} of {task} training: {where}; "
                      f"a task run is not resumable{score}", exit_code=128 + getattr(signal, result.stopped_by))


def _task_params(cfg) -> int:
    import torch

    from lintime.models import CausalLM

    with torch.device("meta"):
        return CausalLM(cfg.model_config()).num_parameters()


def _given_fields(fields: dict, given: frozenset[str] | None) -> set[str]:
    """The config fields whose flags were given.  From the command line ``_given`` says so; a
    Python caller's arguments count as given where they differ from the defaults."""
    if given is not None:
        return {_FIELD.get(k, k) for k in given if k not in _NOT_CONFIG}
    defaults = {_FIELD.get(k, k): p.default for k, p in inspect.signature(train).parameters.items() if k not in _NOT_CONFIG}
    return {k for k, v in fields.items() if v != defaults[k]}


def _resume_config(resume: str, fields: dict, given: set[str]) -> TrainConfig:
    """The resumed run's saved config with the given flags applied; the trainer then refuses any
    of them that a resumed run cannot change and that differs from the run's (even a value equal
    to the flag's default)."""
    from lintime.training import checkpoint as ckpt
    from lintime.training.trainer import without_checkpoint

    run_dir = resume if without_checkpoint(resume) else ckpt.run_dir_of(ckpt.resolve_checkpoint(resume))
    saved = ckpt.read_run_config(run_dir)
    try:
        base = TrainConfig.from_dict(saved.get("train", {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot resume: {run_dir}/config.json has an unusable train config ({err})") from None
    return dataclasses.replace(base, **{k: fields[k] for k in given})


def _init_from_defaults(init_from: str, fields: dict, given: set[str]) -> dict:
    """--init-from without --preset / --tokenizer: the checkpoint's (its architecture and vocabulary)."""
    from lintime.training import checkpoint as ckpt

    saved = ckpt.read_run_config(ckpt.run_dir_of(ckpt.resolve_checkpoint(init_from)))
    src = saved.get("train") or {}
    fields = dict(fields)
    for key in ("preset", "tokenizer"):
        if key not in given and key in src:
            fields[key] = src[key]
    if "objective" not in given:
        fields["objective"] = saved["objective"]
    return fields


def _n_params(config: TrainConfig) -> int | None:
    """Parameters of the model to train (counted on the meta device), for the thread default."""
    import torch

    from lintime.models import CausalLM, get_preset

    try:
        with torch.device("meta"):
            return CausalLM(get_preset(config.preset)).num_parameters()
    except (ValueError, TypeError):
        return None  # an unknown preset: the trainer says so in one line


class _Echo:
    """The trainer's summary lines on stdout; when the reader has gone (`lintime train | head`)
    the run goes on and finishes with nothing more printed."""

    def __init__(self) -> None:
        self.gone = False

    def __call__(self, line: str) -> None:
        if self.gone:
            return
        try:
            try:
                from tqdm import tqdm

                tqdm.write(line, file=sys.stdout)
            except ImportError:
                print(line)
            sys.stdout.flush()
        except BrokenPipeError:
            from lintime.cli import silence_stdout

            silence_stdout()
            self.gone = True

