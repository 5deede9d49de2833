"""The set-up of a training run: everything :func:`lintime.training.trainer.train` does before its first step.

:func:`prepare_run` takes a resolved :class:`~lintime.training.config.TrainConfig` in one process of a
:class:`~lintime.training.parallel.DistEnv` and returns a :class:`Run`: the resumed checkpoint or the
``init_from`` source read (:func:`_starting_point`), the corpus tokenised (:func:`_open_data`), the model
built, loaded and wrapped for context parallelism (:func:`_build_model`), the optimiser and the data
iterator, restored from the checkpoint on a resume (:func:`_build_optimizer`), the run folder written
(:func:`_make_run_folder`), the compiled / graphed forms of the step chosen, and the run announced.

Order matters twice.  Everything that can be refused (config, preset, corpus, tokenizer, device, the resumed
checkpoint's compatibility) is checked before the run folder is created, so a user error leaves no half-made
run.  And the random draws happen in a fixed order (the weights' seed, then the data iterator, then the
distributed dropout seed), which is what makes a resumed run repeat an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import torch

from lintime.data import BatchIterator, DataError, Tokenizer, default_cache_dir, load_tokenizer, open_corpus, prepare
from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.training import checkpoint as ckpt
from lintime.training import parallel as par
from lintime.training.compile import CompiledModel, choose_compile, compile_blocks
from lintime.training.config import RESUMABLE_CHANGES, TrainConfig
from lintime.training.context_parallel import ContextParallel
from lintime.training.graphed import GraphedStep
from lintime.training.rng import seed_everything, set_rng_state
from lintime.training.runguard import RunLock
from lintime.utils.device import autocast_dtype

STATE_FORMAT = 1  # the layout of trainer_state.pt that this trainer writes and resumes


@dataclasses.dataclass
class Run:
    """A run ready for its first (or next, on a resume) step: what the loop of
    :mod:`lintime.training.trainer` reads and updates."""

    cfg: TrainConfig  # resolved, with the token cache's folder filled in
    env: object  # lintime.training.parallel.DistEnv
    run_dir: Path
    tokenizer: Tokenizer
    val_ds: object  # the validation split (lintime.data.TokenDataset)
    model: torch.nn.Module  # the plain model (checkpoints, sampling)
    fwd_model: torch.nn.Module  # the training forward: wrapped for DDP / FSDP, compiled with --compile model
    eval_model: torch.nn.Module  # the validation forward
    graphed: GraphedStep | None  # the whole step in a CUDA graph (--compile graph)
    context: ContextParallel | None
    opt: torch.optim.Optimizer
    opt_step: object  # the optimiser's step (FSDP2: on the local shards)
    train_it: BatchIterator
    amp: torch.dtype | None
    micro_local: int  # rows per micro-batch on this rank
    horizon: int | None  # the step budget
    time_budget: float | None  # seconds
    step: int
    tokens: int
    elapsed: float
    resumed: bool
    restarted: bool  # the folder held a run without a checkpoint, started over
    init_from: Path | None  # the step folder whose weights started the run (config.init_from)
    abandoned: list[Path]  # step folders after the one resumed from: set aside by the first save


@dataclasses.dataclass
class _Start:
    """Where a run starts: a checkpoint to resume (``state``), another run's weights (``init``), or nothing."""

    name: str | None
    out: object
    run_dir: Path | None
    tokenizer: object  # a Tokenizer, or the config's spec until the data is prepared
    restarting: bool
    state: dict | None = None
    step_dir: Path | None = None
    model_cfg_dict: dict | None = None
    abandoned: list[Path] = dataclasses.field(default_factory=list)
    init: dict | None = None


def default_run_name(preset: str) -> str:
    return f"{preset}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def without_checkpoint(path: str | Path) -> bool:
    """True for a run folder that has a ``config.json`` but no checkpoint (stopped before its first
    save): ``resume`` starts it over, and a new run may take its name."""
    path = Path(path)
    return (path / ckpt.CONFIG_FILE).is_file() and not ckpt.list_checkpoints(path)


def check_resume_compatible(saved: TrainConfig, asked: TrainConfig) -> None:
    """Raise ``ValueError`` when ``asked`` changes a setting that a resumed run cannot change."""
    diffs = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in RESUMABLE_CHANGES:
            continue
        a, b = getattr(saved, f.name), getattr(asked, f.name)
        if a != b:
            diffs.append(f"{f.name}={b!r} (the run has {a!r})")
    if diffs:
        raise ValueError(f"cannot resume: the checkpoint was trained with other settings: {'; '.join(diffs[:4])}")


def prepare_run(cfg: TrainConfig, env, *, out, name, resume, progress: bool, say, guards) -> Run:
    """Everything before the first step (module docstring), in one process of ``env``; ``guards``
    (an ``ExitStack``) takes the run folder's lock."""
    start = _starting_point(cfg, env, out=out, name=name, resume=resume, say=say, guards=guards)
    device = env.device
    amp = autocast_dtype(device, cfg.precision)
    if cfg.rows_per_micro_batch % env.dp_size:
        raise ValueError(f"{cfg.rows_per_micro_batch} rows per micro-batch cannot be split over {env.dp_size} "
                         "data-parallel replicas: make --micro-batch-tokens / --context-len rows a multiple of them")
    if cfg.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the 'tensorboard' package: pip install tensorboard") from None
    cfg, corpus, train_ds, val_ds, tokenizer = _open_data(cfg, env, start.tokenizer, progress)
    model_cfg, model, compile_mode, compile_line, context = _build_model(cfg, env, start, tokenizer)
    wrapped, opt, opt_step, train_it, (step, tokens, elapsed) = _build_optimizer(cfg, env, start, model, amp, train_ds,
                                                                                tokenizer)
    run_dir, restarted = _make_run_folder(cfg, env, start, model_cfg, tokenizer, say, guards)
    fwd_model, eval_model = wrapped, model
    if compile_mode == "model" and env.distributed and cfg.parallel == "fsdp" and env.cp_size == 1:
        compile_blocks(model, say)  # in place: FSDP2's hooks stay around each block (wrapped is model)
    elif compile_mode == "model":
        fwd_model = CompiledModel(wrapped, say, "the training step")
        eval_model = CompiledModel(model, say, "the validation forward")
    micro_local = cfg.rows_per_micro_batch // env.dp_size
    # data parallel: this rank's rows, the DDP wrapper left for the eager step a failed capture falls back to
    graphed = GraphedStep(model, opt, rows=cfg.rows_per_batch // env.dp_size, context_len=cfg.context_len,
                          micro_rows=micro_local, clip=cfg.clip, aux_weight=cfg.aux_weight,
                          autocast=amp, fused_loss=cfg.fused, notice=say,
                          doc_capacity=micro_local if cfg.packing == "documents" else None,
                          data_parallel=env if env.distributed else None,
                          ) if compile_mode == "graph" else None
    run = Run(cfg=cfg, env=env, run_dir=run_dir, tokenizer=tokenizer, val_ds=val_ds, model=model, fwd_model=fwd_model,
              eval_model=eval_model, graphed=graphed, context=context, opt=opt, opt_step=opt_step, train_it=train_it,
              amp=amp, micro_local=micro_local, horizon=cfg.step_budget,
              time_budget=cfg.time_minutes * 60 if cfg.time_minutes is not None else None, step=step, tokens=tokens,
              elapsed=elapsed, resumed=start.state is not None, restarted=restarted,
              init_from=start.init["step_dir"] if start.init is not None else None, abandoned=start.abandoned)
    _announce(run, corpus.name, train_ds.n_tokens, compile_line, say)
    return run


def _starting_point(cfg: TrainConfig, env, *, out, name, resume, say, guards) -> _Start:
    """The resumed run's own folder, trainer state, tokenizer and model config (checked against
    ``cfg``), or a new run's tokenizer spec; with ``cfg.init_from``, the source run's weights."""
    if resume is not None and without_checkpoint(resume):
        say(f"lintime train: {resume} has no checkpoint yet: starting the run over")
        name, out, resume, restarting = Path(resume).name, Path(resume).parent, None, True
    else:
        restarting = False
    if resume is None:
        get_preset(cfg.preset)  # an unknown preset fails here, before the data is prepared
        start = _Start(name=name, out=out, run_dir=None, tokenizer=cfg.tokenizer, restarting=restarting)
    else:
        step_dir = ckpt.resolve_checkpoint(resume)
        run_dir = ckpt.run_dir_of(step_dir)
        if env.is_main:
            guards.enter_context(RunLock(run_dir))
        saved = ckpt.read_run_config(run_dir)
        saved_cfg = TrainConfig.from_dict(saved.get("train", {}))
        check_resume_compatible(saved_cfg, cfg)
        if saved["objective"] != cfg.objective:
            raise ValueError(f"cannot resume: the run's objective is {saved['objective']!r}, asked {cfg.objective!r}")
        try:
            tokenizer = load_tokenizer(run_dir / ckpt.TOKENIZER_DIR)
        except DataError as err:
            raise FileNotFoundError(f"cannot resume: {err}") from None
        state = ckpt.load_trainer_state(step_dir)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"cannot resume: {step_dir} has trainer state format {state.get('format')!r}, expected {STATE_FORMAT}")
        abandoned = ckpt.later_checkpoints(step_dir)
        if abandoned:
            say(ckpt.abandon_notice(step_dir, abandoned))
        start = _Start(name=name, out=out, run_dir=run_dir, tokenizer=tokenizer, restarting=restarting, state=state,
                       step_dir=step_dir, model_cfg_dict=saved["model"], abandoned=abandoned)
    if start.state is None and cfg.init_from is not None:
        start.init = _init_source(cfg)
        start.tokenizer = start.init["tokenizer"]
    return start


def _init_source(cfg: TrainConfig) -> dict:
    """What ``cfg.init_from`` (a run or step folder) gives a new run: its step folder, model config
    and tokenizer.  The architecture and vocabulary are the checkpoint's: ``cfg.preset`` must be
    the preset it was trained as, and ``cfg.tokenizer`` its tokenizer (spec or name)."""
    step_dir = ckpt.resolve_checkpoint(cfg.init_from)
    run_dir = ckpt.run_dir_of(step_dir)
    saved = ckpt.read_run_config(run_dir)
    src = saved.get("train") or {}
    if saved["objective"] != cfg.objective:
        raise ValueError(f"--init-from {cfg.init_from}: a {saved['objective']} model cannot start a {cfg.objective} run")
    if src.get("preset", cfg.preset) != cfg.preset:
        raise ValueError(f"--init-from {cfg.init_from}: the checkpoint is a {src['preset']} model, not {cfg.preset} "
                         f"(the architecture cannot change: pass --preset {src['preset']} or leave --preset out)")
    try:
        tokenizer = load_tokenizer(run_dir / ckpt.TOKENIZER_DIR)
    except DataError as err:
        raise FileNotFoundError(f"--init-from {cfg.init_from}: {err}") from None
    if cfg.tokenizer not in (src.get("tokenizer"), tokenizer.name):
        raise ValueError(f"--init-from {cfg.init_from}: the checkpoint's vocabulary is tokenizer {tokenizer.name} "
                         f"({tokenizer.vocab_size} ids), and --tokenizer {cfg.tokenizer} would give another one: "
                         f"leave --tokenizer out to keep it")
    return {"step_dir": step_dir, "model": ModelConfig.from_dict(saved["model"]), "tokenizer": tokenizer}


def _open_data(cfg: TrainConfig, env, tokenizer, progress: bool):
    """``(cfg, corpus, train split, validation split, tokenizer)``: the corpus tokenised into its cache (one
    process builds it, the others read it); ``DataError`` for a missing or empty corpus, before anything is
    written.  ``cfg`` comes back with its ``cache_dir`` filled in."""
    corpus = open_corpus(cfg.corpus, text_field=cfg.text_field)
    if cfg.cache_dir is None:
        spec = tokenizer.name if isinstance(tokenizer, Tokenizer) else tokenizer
        cfg = dataclasses.replace(cfg, cache_dir=str(default_cache_dir(corpus.name, spec)))
    with par.main_first(env):  # one process builds the token cache, the others read it
        splits = prepare(corpus, tokenizer, cfg.cache_dir, splits=("train", "validation"), quiet=not progress)
    return cfg, corpus, splits["train"], splits["validation"], splits["train"].tokenizer


def _build_model(cfg: TrainConfig, env, start: _Start, tokenizer):
    """``(model config, model, compile mode, compile notice, context parallel)``: the model on the device, its
    weights drawn from the weights' seed and then loaded from the resumed checkpoint or ``init_from``."""
    device = env.device
    if start.state is not None:
        model_cfg = ModelConfig.from_dict(start.model_cfg_dict)
    elif start.init is not None:
        model_cfg = start.init["model"]
    else:
        model_cfg = get_preset(cfg.preset, vocab_size=tokenizer.vocab_size)  # the vocabulary is the tokenizer's
    # the same initial weights on every rank; init_seed draws them apart from the data's seed
    seed_everything(cfg.seed if cfg.init_seed is None else cfg.init_seed, cfg.deterministic)
    model = (CausalLM if cfg.objective == "clm" else MaskedLM)(model_cfg)
    model.to(device)
    compile_mode, compile_line = choose_compile(
        cfg.compile, device=device, distributed=env.distributed, packing=cfg.packing,
        static_packing=model.backbone.static_packing(), parallel=cfg.parallel, cp_size=env.cp_size,
        updates_buffers=any(getattr(m, "updates_buffers", False) for m in model.modules()))
    if compile_mode == "model" and not hasattr(torch, "compile"):
        raise ValueError("--compile model needs torch.compile (PyTorch >= 2.0)")
    if start.state is not None:
        ckpt.load_weights(model, start.step_dir, device)
    elif start.init is not None:
        ckpt.load_weights(model, start.init["step_dir"], device)
    model.train()
    model.set_fused(cfg.fused)
    context = ContextParallel(model, env) if env.cp_size > 1 else None
    if context is not None:
        context.check_length(cfg.context_len)
    return model_cfg, model, compile_mode, compile_line, context


def _build_optimizer(cfg: TrainConfig, env, start: _Start, model, amp, train_ds, tokenizer):
    """``(wrapped model, optimiser, its step, data iterator, (step, tokens, elapsed))``: AdamW over the model
    wrapped for data parallelism, and the data iterator of this rank; on a resume both (and every RNG) are
    restored from the checkpoint."""
    device = env.device

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            m.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            **({"fused": True} if device.type == "cuda" else {}),
        )

    state, step_dir = start.state, start.step_dir
    full_optim = None  # a single-process checkpoint's optimizer state, by parameter name (distributed resume)
    if state is not None and env.distributed and state.get("optimizer") != ckpt.DCP_MARK:
        full_optim = ckpt.optimizer_state_by_name(model, make_optimizer(model), state["optimizer"], step_dir)
    wrapped = par.wrap_model(model, env, cfg.parallel, amp)
    opt = make_optimizer(model)
    # FSDP2: the update runs on the local shards (no DTensor dispatch); opt keeps the sharded state
    opt_step = par.ShardStep(opt).step if env.distributed and cfg.parallel == "fsdp" else opt.step
    train_it = BatchIterator(train_ds, batch_size=cfg.rows_per_batch // env.dp_size, context_len=cfg.context_len,
                             tokenizer=tokenizer, objective=cfg.objective, seed=cfg.seed, mlm_prob=cfg.mlm_prob,
                             rank=env.dp_rank, world_size=env.dp_size)
    step, tokens_seen, elapsed = 0, 0, 0.0
    if state is not None:
        if state.get("optimizer") == ckpt.DCP_MARK:
            ckpt.load_sharded_optimizer(model, opt, step_dir)
        elif full_optim is not None:
            ckpt.set_optimizer_by_name(model, opt, full_optim)
        else:
            try:
                opt.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise ValueError(f"cannot resume: the optimizer state in {step_dir} does not fit this model ({ckpt._one_line(err)})") from None
        train_it.load_state_dict(state["data"], reshard=True)  # DataError if the data or settings changed
        set_rng_state(state["rng"])
        step, tokens_seen, elapsed = int(state["step"]), int(state["tokens"]), float(state["elapsed_s"])
    if env.distributed:
        # dropout masks differ between ranks (each rank holds other rows or another slice)
        torch.manual_seed(cfg.seed + 1_000_003 * (env.rank + 1) + step)
    return wrapped, opt, opt_step, train_it, (step, tokens_seen, elapsed)


def _make_run_folder(cfg: TrainConfig, env, start: _Start, model_cfg, tokenizer, say, guards) -> tuple[Path, bool]:
    """``(run folder, restarted)``: a new run's folder named and locked (refused when it holds a run with a
    checkpoint; started over when it holds one without), and its ``config.json`` / ``tokenizer/`` written.
    Nothing is written before this point."""
    run_dir, restarted = start.run_dir, False
    if run_dir is None:
        run_dir = Path(start.out) / par.broadcast_str(start.name or default_run_name(cfg.preset), env)
        if env.is_main:
            if (run_dir / ckpt.CONFIG_FILE).exists() and not without_checkpoint(run_dir):
                raise ValueError(f"run folder {run_dir} already holds a run: pick another --name, or --resume {run_dir}")
            guards.enter_context(RunLock(run_dir))
            restarted = (run_dir / ckpt.CONFIG_FILE).exists()
            if restarted and not start.restarting:
                say(f"lintime train: {run_dir} holds a run without a checkpoint: starting it over")
    par.barrier(env)
    if env.is_main:
        ckpt.write_run_config(run_dir, model_config=model_cfg, objective=cfg.objective, tokenizer=tokenizer,
                              train=cfg.to_dict())
    par.barrier(env)
    return run_dir, restarted


def _announce(run: Run, corpus_name: str, train_tokens: int, compile_line: str | None, say) -> None:
    """The lines that open a run: model, data, device, budget, recipe, folder, compile choice, init source."""
    cfg, env = run.cfg, run.env
    say(f"lintime train: {cfg.preset} ({run.model.num_parameters() / 1e6:.2f}M parameters, {cfg.objective}) on "
        f"{corpus_name} ({train_tokens / 1e6:.1f}M train tokens, tokenizer {run.tokenizer.name}), {env.device.type}"
        f"{' bf16' if run.amp is not None else ' fp32'}"
        f"{f', {env.world} processes ({cfg.parallel} x {env.dp_size}' if env.distributed else ''}"
        f"{f', context parallel {env.cp_size})' if env.cp_size > 1 else (')' if env.distributed else '')}")
    budget = []
    if run.horizon is not None:
        budget.append(f"{run.horizon} steps")
    if run.time_budget is not None:
        budget.append(f"{cfg.time_minutes:g} min")
    say(f"  {' or '.join(budget)} x {cfg.rows_per_batch} rows x {cfg.context_len} tokens"
        f"{f' ({cfg.accumulation_steps} micro-batches)' if cfg.accumulation_steps > 1 else ''}; "
        f"recipe {cfg.recipe}: lr {cfg.lr:g}, warm-up {cfg.warmup:.0%}, {cfg.decay} decay, clip {cfg.clip:g}"
        f"{f'; resuming at step {run.step}' if run.resumed else ''}")
    say(f"  run folder: {run.run_dir}")
    if compile_line is not None:
        say(compile_line)
    if run.init_from is not None:
        say(f"  initialised from {run.init_from} (weights only; new data, schedule and budget)")
