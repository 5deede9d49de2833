"""``lintime train``: the flags are :class:`lintime.training.TrainConfig`'s fields (see docs/cli.md)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing

from lintime.cli import CLIError, Stopped, check_writable, command, set_threads
from lintime.training.config import TrainConfig

HELP_OUT = 'folder that holds the runs.'
HELP_NAME = 'run name (default: <preset>-<date>-<time>).'
HELP_RESUME = 'continue the run in this run folder (or from this step folder).'
HELP_PROGRESS = 'show the progress bar (on a terminal; elsewhere a line every 30 seconds).'
HELP_THREADS = "CPU threads for PyTorch's intra-op work (0 = auto: 1 for models under 20M parameters, else PyTorch's default)."
HELP_TASK = "lm (language modelling on --corpus) or mqar (Zoology's associative recall, Zoology's recipe: see docs/results_recall.md); with mqar, --context-len is the sequence length (default 64), --tokens-per-batch / --context-len the batch rows (default Zoology's), --lr the peak rate (default 1e-3), --steps a cap."
HELP_KV_PAIRS = 'mqar: key-value pairs per example.'
HELP_TASK_VOCAB = 'mqar: vocabulary of the task (and of the model).'
HELP_D_MODEL = "mqar: model width (default: the preset's)."
HELP_N_LAYERS = "mqar: blocks (default 2, Zoology's; 0 = the preset's)."
HELP_N_HEADS = "mqar: heads of the mixer (default: the preset's; Zoology's attention has 1)."
HELP_POSITION = "mqar: absolute positions none, scaled_sin or learned (default: the preset's)."
HELP_EXAMPLES = 'mqar: training examples (a fixed set, seen once per epoch).'
HELP_MQAR_MIX = ("mqar: train one model on a mixture of points (Zoology's multi-point training): 'zoology' (64x4:100000,"
                 "128x8:20000,256x16:20000,256x32:20000,256x64:20000), LENxPAIRS:EXAMPLES,... or LENxPAIRS,... (--examples "
                 "split equally); every batch holds each point in its proportion, rows padded to the longest; instead "
                 "of --context-len / --kv-pairs.")
HELP_EPOCHS = "mqar: epochs (the cosine schedule's length; training stops early once the test accuracy passes 0.99)."

_D = TrainConfig()
# flags that are not TrainConfig fields: where the run goes and how it runs, and --task mqar's own (name -> (type,
# default, help)); every other flag is a TrainConfig field, its type, default and help declared there once
_OWN = {
    "out": (str, "runs", HELP_OUT),
    "name": (str | None, None, HELP_NAME),
    "resume": (str | None, None, HELP_RESUME),
    "progress": (bool, True, HELP_PROGRESS),
    "threads": (int, 0, HELP_THREADS),
    "task": (str, "lm", HELP_TASK),
    "kv_pairs": (int, 4, HELP_KV_PAIRS),
    "task_vocab": (int, 8192, HELP_TASK_VOCAB),
    "d_model": (int | None, None, HELP_D_MODEL),
    "n_layers": (int | None, None, HELP_N_LAYERS),
    "n_heads": (int | None, None, HELP_N_HEADS),
    "position": (str | None, None, HELP_POSITION),
    "examples": (int, 100_000, HELP_EXAMPLES),
    "epochs": (int, 64, HELP_EPOCHS),
    "mqar_mix": (str | None, None, HELP_MQAR_MIX),
}
_CLI_TYPES = {"compile": bool | str}  # --compile alone means auto, --no-compile off (the config also takes bools)
_TASK_FLAGS = ("task", "kv_pairs", "task_vocab", "d_model", "n_layers", "n_heads", "position", "examples", "epochs",
               "mqar_mix")
_NOT_CONFIG = tuple(_OWN) + ("_given",)
_FIELD = {f.metadata["flag"]: f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("flag")}
_SUMMARY = """Train a language model with a seed's recipe; with no arguments, a tiny FLASH on the Python
    standard library (byte tokenizer), a few minutes on a laptop CPU.
    
    Leaves runs/<name>/ with config.json, tokenizer/, checkpoints/, metrics.jsonl/.csv, loss plots
    and sample.txt.  Ctrl-C (or SIGTERM) saves a checkpoint and stops; continue with --resume
    runs/<name> (same settings: a given flag that differs from the run's is refused, except budgets,
    logging, saving, sampling and device flags).  --init-from RUN starts from a trained model's
    weights with new data, schedule and budget (fine-tuning)."""


def _signature() -> tuple[inspect.Signature, dict, str]:
    """The command's parameters, annotations and docstring, from TrainConfig's fields and :data:`_OWN`."""
    hints = typing.get_type_hints(TrainConfig)
    params, annotations, lines = [], {}, []
    for f in dataclasses.fields(TrainConfig):
        flag = f.metadata.get("flag") or f.name
        typ = _CLI_TYPES.get(f.name, hints[f.name])
        params.append(inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=typ))
        annotations[flag] = typ
        lines.append(f"        {flag}: {f.metadata['help']}")
    for flag, (typ, default, help_) in _OWN.items():
        params.append(inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=typ))
        annotations[flag] = typ
        lines.append(f"        {flag}: {help_}")
    params.append(inspect.Parameter("_given", inspect.Parameter.KEYWORD_ONLY, default=None))
    doc = _SUMMARY + "\n\n    Args:\n" + "\n".join(lines) + "\n"
    return inspect.Signature(params), annotations, doc


def train(**kwargs) -> None:
    """(replaced below by the generated docstring)"""
    bound = _SIGNATURE.bind(**kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    _given = args.pop("_given")
    task, resume, init_from, out, name, threads, progress = (args[k] for k in (
        "task", "resume", "init_from", "out", "name", "threads", "progress"))
    if task != "lm":
        given_flags = set(_given) if _given is not None else {k for k, v in args.items() if k in _TASK_ARGS and v != _TASK_ARGS[k]}
        return _train_task(task, {k: v for k, v in args.items() if k in _TASK_ARGS}, given_flags)
    if _given is not None and set(_given) & set(_TASK_FLAGS):
        raise CLIError(f"{', '.join('--' + k.replace('_', '-') for k in sorted(set(_given) & set(_TASK_FLAGS)))} "
                       "apply to --task mqar only")
    fields = {_FIELD.get(k, k): v for k, v in args.items() if k not in _NOT_CONFIG}
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


_SIGNATURE, train.__annotations__, train.__doc__ = _signature()
train.__signature__ = _SIGNATURE
command(train)

# flags that --task mqar reads, with their defaults; any other given flag is refused
_TASK_ARGS = {k: _SIGNATURE.parameters[k].default for k in (
    "preset", "context_len", "tokens_per_batch", "steps", "lr", "weight_decay", "seed", "init_seed", "device",
    "precision", "out", "name", "progress", "threads", *_TASK_FLAGS)}


def _train_task(task: str, args: dict, given: set[str]) -> None:
    """``lintime train --task mqar``: :func:`lintime.training.tasks.train_task` with the flags that
    apply to it (Zoology's sequence length 64, rate 1e-3, batch rows and 2 layers by default)."""
    from lintime.training.tasks import TASKS, TaskTrainConfig, train_task

    if task not in TASKS:
        raise CLIError(f"--task must be lm or one of {', '.join(TASKS)}, got {task!r}")
    other = sorted(k for k in given if k not in _TASK_ARGS and not k.startswith("_"))
    if other:
        raise CLIError(f"--task {task} does not use {', '.join('--' + k.replace('_', '-') for k in other)}")
    mix = None
    if args["mqar_mix"] is not None:
        from lintime.evaluation.tasks.mqar import parse_mix

        both = sorted(k for k in ("context_len", "kv_pairs") if k in given)
        if both:
            raise CLIError(f"--mqar-mix gives the points: drop {', '.join('--' + k.replace('_', '-') for k in both)}")
        try:
            mix = parse_mix(args["mqar_mix"], args["examples"])
        except ValueError as err:
            raise CLIError(f"--mqar-mix: {err}") from None
        if "examples" in given and ":" in args["mqar_mix"]:
            raise CLIError("--mqar-mix gives each point's examples: drop --examples")
    seq_len = max(T for T, _, _ in mix) if mix else args["context_len"] if "context_len" in given else 64
    rows = args["tokens_per_batch"] // seq_len if "tokens_per_batch" in given else None
    if rows == 0:
        raise CLIError(f"--tokens-per-batch {args['tokens_per_batch']} is less than one row of {seq_len} tokens")
    try:
        cfg = TaskTrainConfig(mix=mix, 
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

