"""The training loop.

:func:`train` runs one :class:`~lintime.training.config.TrainConfig` into a run folder (layout:
:mod:`lintime.training.checkpoint`), or continues one from a checkpoint.  A step's gradients and
the validation loss come from :mod:`lintime.training.step` (:func:`forward_backward`,
:func:`evaluate`; the loss is defined there), the RNG state a checkpoint holds from
:mod:`lintime.training.rng`, the distributed set-up from :mod:`lintime.training.parallel`.

Resume: the checkpoint holds the optimiser, the data iterator's position, every RNG state, the
step, tokens and elapsed time; the schedule is a pure function of the step.  So on a fixed device
(CPU fp32 tested) a resumed run produces exactly the per-step losses of an uninterrupted one.

Host reads: an eager step reads nothing on the host (a read waits for every queued kernel, and the
host could be issuing the next step meanwhile).  Its loss, auxiliary loss and gradient norm stay
on the device (:class:`~lintime.training.step.StepStats`) until a logged step reads them all at
once -- or an evaluation, a checkpoint, the end, or ``MAX_UNREAD_STEPS`` -- where a non-finite one
ends the run, named by its step, before anything is evaluated or saved.  ``time_s`` is the loop's
wall time outside evaluations and checkpoints (batch fetch included; the device catches up at reads).

A run folder never becomes a dead end (:mod:`lintime.training.runguard`): one process writes it
at a time (a lock file); SIGINT / SIGTERM save a checkpoint at the current step and stop; a
folder without a checkpoint (killed early, or diverged before its first save) is started over
under its name or by ``resume``; a diverged run writes no checkpoint of the diverged model.
``config.init_from`` starts a new run from another run's weights (fine-tuning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lintime.data import (
    IGNORE_INDEX,
    BatchIterator,
    DataError,
    Tokenizer,
    default_cache_dir,
    load_tokenizer,
    open_corpus,
    prepare,
)
from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.training import checkpoint as ckpt
from lintime.training import parallel as par
from lintime.training.compile import CompiledModel, choose_compile
from lintime.training.config import RESUMABLE_CHANGES, TrainConfig
from lintime.training.context_parallel import ContextParallel
from lintime.training.graphed import GraphedStep, one_sequence_per_row
from lintime.training.metrics import MetricsWriter, plot_metrics
from lintime.training.rng import rng_state, seed_everything, set_rng_state
from lintime.training.runguard import RunLock, StopSignals
from lintime.training.schedule import lr_at_progress, lr_at_step
from lintime.training.step import StepStats, describe_val, evaluate, forward_backward
from lintime.utils.device import autocast_dtype

STATE_FORMAT = 1
SAMPLE_FILE = "sample.txt"
MAX_UNREAD_STEPS = 100  # a run that logs rarely (or never) still checks its loss this often


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns."""

    run_dir: Path
    step: int
    tokens: int
    elapsed_s: float  # training wall time (without validation and checkpoints), summed over resumes
    first_loss: float | None  # loss of the first step taken by this call
    last_loss: float | None  # loss of the last step taken by this call
    val: dict | None  # the final validation metrics: val_loss and val_bpb or val_ppl
    sample: str | None
    checkpoint: Path | None
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped the run (checkpoint saved)


# ---------------------------------------------------------------------------------------------
# run set-up


def default_run_name(preset: str) -> str:
    return f"{preset}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


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


def _echo_default(line: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
    except ImportError:
        print(line, flush=True)


def corpus_prompt(dataset, tokenizer, max_chars: int = 24) -> str:
    """A prompt taken from the corpus, for the final sample when none is given: the first non-blank line
    of the first validation document, cut to ``max_chars`` at a word boundary."""
    for i in range(min(len(dataset), 16)):
        text = tokenizer.decode([int(t) for t in dataset[i][:4 * max_chars]])
        line = next((ln for ln in text.splitlines() if ln.strip()), "")
        if not line:
            continue
        if len(line) <= max_chars:
            return line
        cut = line[:max_chars]
        space = cut.rstrip().rfind(" ")
        return cut[:space + 1] if space > 0 else cut
    return "\n"


PROGRESS_EVERY_S = 30.0  # without a terminal (a log file, a pipe), a progress line this often


class _Bar:
    """tqdm progress bar on a terminal; elsewhere (or without tqdm) a plain line on stderr every
    ``PROGRESS_EVERY_S`` seconds; nothing when disabled."""

    def __init__(self, total: int | None, initial: int, enabled: bool, unit: str):
        self._bar = None
        self._plain_total = total
        self._n = initial
        self._last_print = time.monotonic()
        self.enabled = enabled
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True, file=sys.stderr,
                         desc="train", smoothing=0.1)

    def update(self, n: int, postfix: str) -> None:
        self._n += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)
        elif time.monotonic() - self._last_print >= PROGRESS_EVERY_S:
            self._last_print = time.monotonic()
            of = f"/{self._plain_total}" if self._plain_total else ""
            print(f"train: step {self._n}{of}  {postfix}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------------
# the loop


def train(
    config: TrainConfig,
    *,
    out: str | Path = "runs",
    name: str | None = None,
    resume: str | Path | None = None,
    progress: bool = True,
    echo: Callable[[str], None] | None = _echo_default,
    stop_after: int | None = None,
) -> TrainResult:
    """Train ``config`` into ``out/name`` (default name: preset + timestamp), or continue the run
    that ``resume`` (a run or step folder) points at.

    ``progress``: show a progress bar on stderr; ``echo``: where the summary lines go (``None``:
    nowhere).  ``stop_after``: stop after this many steps of this call, as if interrupted (tests;
    a checkpoint is written as at the end of a run).

    Everything that can be checked is checked before the run folder is created (config, preset,
    corpus, tokenizer, device, the resumed checkpoint's compatibility), so a user error never
    leaves a half-made run behind.
    """
    cfg = config.resolved()
    if cfg.context_parallel > 1 and cfg.objective != "clm":
        raise ValueError("--context-parallel needs --objective clm (a masked LM sees its whole row at once)")
    # a process group the caller started (several runs in one set of processes) is the caller's
    # to end; one started here ends here, aborted after an error so no other rank waits on it
    owned = not par.dist.is_initialized()
    env = par.init_distributed(cfg.device, cfg.parallel, cfg.context_parallel)
    failed = True
    try:
        with contextlib.ExitStack() as guards:
            result = _train(cfg, env, out=out, name=name, resume=resume, progress=progress and env.is_main,
                            echo=echo if env.is_main else None, stop_after=stop_after, guards=guards)
        failed = False
        return result
    finally:
        if env.distributed and owned:
            par.shutdown(failed)


def without_checkpoint(path: str | Path) -> bool:
    """True for a run folder that has a ``config.json`` but no checkpoint (stopped before its first
    save): ``resume`` starts it over, and a new run may take its name."""
    path = Path(path)
    return (path / ckpt.CONFIG_FILE).is_file() and not ckpt.list_checkpoints(path)


def _train(cfg: TrainConfig, env, *, out, name, resume, progress, echo, stop_after, guards) -> TrainResult:
    """:func:`train` in one process of ``env`` (:class:`lintime.training.parallel.DistEnv`);
    ``guards`` (an ``ExitStack``) holds the run folder's lock until the caller leaves it."""
    say = echo or (lambda line: None)

    # ---- resume: the run's own folder, tokenizer and model config
    state = None
    abandoned: list[Path] = []  # step folders after the one resumed from: set aside by the first save
    if resume is not None and without_checkpoint(resume):
        say(f"lintime train: {resume} has no checkpoint yet: starting the run over")
        name, out, resume, restarting = Path(resume).name, Path(resume).parent, None, True
    else:
        restarting = False
    if resume is not None:
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
        model_cfg_dict = saved["model"]
        state = ckpt.load_trainer_state(step_dir)
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"cannot resume: {step_dir} has trainer state format {state.get('format')!r}, expected {STATE_FORMAT}")
        abandoned = ckpt.later_checkpoints(step_dir)
        if abandoned:
            say(ckpt.abandon_notice(step_dir, abandoned))
    else:
        get_preset(cfg.preset)  # an unknown preset fails here, before the data is prepared
        tokenizer = cfg.tokenizer
        run_dir = None
    init = _init_source(cfg) if state is None and cfg.init_from is not None else None
    if init is not None:
        tokenizer = init["tokenizer"]

    device = env.device
    amp = autocast_dtype(device, cfg.precision)
    if cfg.rows_per_micro_batch % env.dp_size:
        raise ValueError(f"{cfg.rows_per_micro_batch} rows per micro-batch cannot be split over {env.dp_size} "
                         "data-parallel replicas: make --micro-batch-tokens / --context-len rows a multiple of them")
    rows_local, micro_local = cfg.rows_per_batch // env.dp_size, cfg.rows_per_micro_batch // env.dp_size
    if cfg.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the 'tensorboard' package: pip install tensorboard") from None

    # ---- data (DataError for a missing / empty corpus, before anything is written)
    corpus = open_corpus(cfg.corpus, text_field=cfg.text_field)
    if cfg.cache_dir is None:
        spec = tokenizer.name if isinstance(tokenizer, Tokenizer) else tokenizer
        cfg = dataclasses.replace(cfg, cache_dir=str(default_cache_dir(corpus.name, spec)))
    with par.main_first(env):  # one process builds the token cache, the others read it
        splits = prepare(corpus, tokenizer, cfg.cache_dir, splits=("train", "validation"), quiet=not progress)
    tokenizer = splits["train"].tokenizer
    train_ds, val_ds = splits["train"], splits["validation"]

    # ---- model
    if state is not None:
        model_cfg = ModelConfig.from_dict(model_cfg_dict)
    elif init is not None:
        model_cfg = init["model"]
    else:
        model_cfg = get_preset(cfg.preset, vocab_size=tokenizer.vocab_size)  # the vocabulary is the tokenizer's
    # the same initial weights on every rank; init_seed draws them apart from the data's seed
    seed_everything(cfg.seed if cfg.init_seed is None else cfg.init_seed, cfg.deterministic)
    model = (CausalLM if cfg.objective == "clm" else MaskedLM)(model_cfg)
    model.to(device)
    compile_mode, compile_line = choose_compile(cfg.compile, device=device, distributed=env.distributed,
                                                packing=cfg.packing, static_packing=model.backbone.static_packing())
    if compile_mode == "model" and not hasattr(torch, "compile"):
        raise ValueError("--compile model needs torch.compile (PyTorch >= 2.0)")
    if state is not None:
        ckpt.load_weights(model, step_dir, device)
    elif init is not None:
        ckpt.load_weights(model, init["step_dir"], device)
    model.train()
    model.set_fused(cfg.fused)
    context = ContextParallel(model, env) if env.cp_size > 1 else None
    if context is not None:
        context.check_length(cfg.context_len)

    def make_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            m.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            **({"fused": True} if device.type == "cuda" else {}),
        )

    full_optim = None  # a single-process checkpoint's optimizer state, by parameter name (distributed resume)
    if state is not None and env.distributed and state.get("optimizer") != ckpt.DCP_MARK:
        full_optim = ckpt.optimizer_state_by_name(model, make_optimizer(model), state["optimizer"], step_dir)
    wrapped = par.wrap_model(model, env, cfg.parallel, amp)
    opt = make_optimizer(model)
    # FSDP2: the update runs on the local shards (no DTensor dispatch); opt keeps the sharded state
    opt_step = par.ShardStep(opt).step if env.distributed and cfg.parallel == "fsdp" else opt.step
    train_it = BatchIterator(train_ds, batch_size=rows_local, context_len=cfg.context_len,
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

    # ---- the run folder (nothing was written before this point)
    restarted = False
    if run_dir is None:
        run_dir = Path(out) / par.broadcast_str(name or default_run_name(cfg.preset), env)
        if env.is_main:
            if (run_dir / ckpt.CONFIG_FILE).exists() and not without_checkpoint(run_dir):
                raise ValueError(f"run folder {run_dir} already holds a run: pick another --name, or --resume {run_dir}")
            guards.enter_context(RunLock(run_dir))
            restarted = (run_dir / ckpt.CONFIG_FILE).exists()
            if restarted and not restarting:
                say(f"lintime train: {run_dir} holds a run without a checkpoint: starting it over")
    par.barrier(env)
    if env.is_main:
        ckpt.write_run_config(run_dir, model_config=model_cfg, objective=cfg.objective, tokenizer=tokenizer,
                              train=cfg.to_dict())
    par.barrier(env)
    fwd_model = CompiledModel(wrapped, say, "the training step") if compile_mode == "model" else wrapped
    eval_model = CompiledModel(model, say, "the validation forward") if compile_mode == "model" else model
    graphed = GraphedStep(model, opt, rows=cfg.rows_per_batch, context_len=cfg.context_len,
                          micro_rows=cfg.rows_per_micro_batch, clip=cfg.clip, aux_weight=cfg.aux_weight,
                          autocast=amp, fused_loss=cfg.fused, notice=say,
                          doc_capacity=cfg.rows_per_micro_batch if cfg.packing == "documents" else None,
                          ) if compile_mode == "graph" else None

    horizon = cfg.step_budget
    time_budget = cfg.time_minutes * 60 if cfg.time_minutes is not None else None
    n_params = model.num_parameters()
    say(f"lintime train: {cfg.preset} ({n_params / 1e6:.2f}M parameters, {cfg.objective}) on {corpus.name} "
        f"({train_ds.n_tokens / 1e6:.1f}M train tokens, tokenizer {tokenizer.name}), {device.type}"
        f"{' bf16' if amp is not None else ' fp32'}"
        f"{f', {env.world} processes ({cfg.parallel} x {env.dp_size}' if env.distributed else ''}"
        f"{f', context parallel {env.cp_size})' if env.cp_size > 1 else (')' if env.distributed else '')}")
    budget = []
    if horizon is not None:
        budget.append(f"{horizon} steps")
    if time_budget is not None:
        budget.append(f"{cfg.time_minutes:g} min")
    say(f"  {' or '.join(budget)} x {cfg.rows_per_batch} rows x {cfg.context_len} tokens"
        f"{f' ({cfg.accumulation_steps} micro-batches)' if cfg.accumulation_steps > 1 else ''}; "
        f"recipe {cfg.recipe}: lr {cfg.lr:g}, warm-up {cfg.warmup:.0%}, {cfg.decay} decay, clip {cfg.clip:g}"
        f"{f'; resuming at step {step}' if state is not None else ''}")
    say(f"  run folder: {run_dir}")
    if compile_line is not None:
        say(compile_line)

    def save(val: dict | None) -> Path:
        # never save a diverged model (sharded parameters are checked through the loss only)
        if not env.distributed and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise ValueError(_diverged(run_dir, step, float("nan"), float("nan"), "the weights hold NaN or infinity"))
        trainer_state = {
            "format": STATE_FORMAT,
            "step": step,
            "tokens": tokens_seen,
            "elapsed_s": elapsed,
            "optimizer": ckpt.DCP_MARK if env.distributed else opt.state_dict(),
            "scheduler": {"kind": cfg.decay, "horizon_steps": horizon, "time_budget_s": time_budget, "lr": last_lr},
            "data": train_it.state_dict(),
            "rng": rng_state(),
            "val": val or {},
        }
        if env.distributed:
            saved_to = ckpt.save_distributed_checkpoint(run_dir, step, model, opt, trainer_state, keep=cfg.keep,
                                                        abandon=abandoned,
                                                        build=lambda: ckpt.build_model(ckpt.read_run_config(run_dir)))
        else:
            saved_to = ckpt.save_checkpoint(run_dir, step, model, trainer_state, keep=cfg.keep, abandon=abandoned)
        abandoned.clear()  # the first save sets them aside
        return saved_to

    def run_eval() -> dict:
        out = evaluate(eval_model, val_ds, context_len=cfg.context_len, rows=cfg.rows_per_micro_batch,
                       max_tokens=cfg.eval_tokens, objective=cfg.objective, seed=cfg.seed,
                       mlm_prob=cfg.mlm_prob, autocast=amp, tokenizer=tokenizer)
        if env.distributed and cfg.parallel == "fsdp":
            par.reshard(model)  # a forward without backward leaves the root unsharded (a full copy)
        if not math.isfinite(out["val_loss"]):
            raise ValueError(_diverged(run_dir, step, out["val_loss"], 0.0, f"the validation loss is {out['val_loss']}"))
        return out

    def done() -> bool:
        if horizon is not None and step >= horizon:
            return True
        if time_budget is not None and elapsed >= time_budget:
            return True
        return stop_after is not None and taken >= stop_after

    if init is not None:
        say(f"  initialised from {init['step_dir']} (weights only; new data, schedule and budget)")
    resume_step = step if state is not None else (0 if restarted else None)  # drop rows after it
    metrics = (MetricsWriter(run_dir, resume_step=resume_step, tensorboard=cfg.tensorboard)
               if env.is_main else _NoMetrics())
    bar = _Bar(horizon, step, progress, unit="step")
    taken = 0
    first_loss = last_loss = None
    last_lr = cfg.lr
    val: dict | None = None
    val_step = -1
    last_ckpt = None
    window_loss, window_n, window_tokens, window_time = 0.0, 0, 0, 0.0
    # the steps' numbers stay on the device until a logged step (or eval, save, the end) reads them
    stats = StepStats(device, shares=env.distributed and graphed is None)
    loss = aux = grad_norm = None  # of the last step read

    def read_stats() -> None:
        nonlocal first_loss, last_loss, loss, aux, grad_norm, window_loss, window_n
        for at, loss, aux, grad_norm in stats.read():  # one host read: waits for the queued steps
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise ValueError(_diverged(run_dir, at, loss, grad_norm))
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            window_loss += loss
            window_n += 1

    # a signal stops one process alone; under torchrun the launcher stops every rank
    stop = StopSignals()
    if not env.distributed:
        stop.__enter__()
    try:
        while not (done() or stop.received):
            t0 = time.perf_counter()
            batch = next(train_it)
            batch = one_sequence_per_row(batch) if cfg.packing == "rows" else batch
            if horizon is not None:
                lr = lr_at_step(step, horizon, peak=cfg.lr, warmup=cfg.warmup, decay=cfg.decay, final_lr_ratio=cfg.final_lr_ratio)
            else:
                lr = lr_at_progress(elapsed / time_budget, peak=cfg.lr, warmup=cfg.warmup, decay=cfg.decay,
                                    final_lr_ratio=cfg.final_lr_ratio)
            out = (graphed.step(batch.input_ids, batch.targets, lr,
                                cu_seqlens=batch.cu_seqlens if graphed.packed else None)
                   if graphed is not None else None)
            if out is not None:  # the graph took the optimizer step
                stats.add(step + 1, out.loss, out.aux, out.grad_norm)
            else:
                for group in opt.param_groups:
                    group["lr"] = lr
                # distributed: the predicted tokens of the global batch, summed on the device (no host read)
                n_global = par.global_count(int((batch.targets != IGNORE_INDEX).sum()), env) if env.distributed else None
                step_loss, step_aux = forward_backward(
                    fwd_model, batch, micro_rows=micro_local, aux_weight=cfg.aux_weight, autocast=amp, n_targets=n_global,
                    replicas=env.world, loss_scale=float(env.world) if env.distributed and cfg.parallel != "none" else 1.0,
                    context=context, fused_loss=cfg.fused, to_host=False)
                par.finish_grads(model, env, cfg.parallel)
                norm = par.clip_grad_norm(model, cfg.clip if cfg.clip > 0 else math.inf, to_host=False)
                opt_step()  # a non-finite step is caught when read, before any checkpoint or evaluation
                opt.zero_grad(set_to_none=True)
                stats.add(step + 1, step_loss, step_aux, norm)
            step += 1
            taken += 1
            tokens_seen += cfg.tokens_per_batch
            last_lr = lr
            dt = time.perf_counter() - t0  # host time: the device catches up at the next read
            elapsed += dt
            end = done()
            log_now = bool(cfg.log_every) and step % cfg.log_every == 0
            eval_now = bool(cfg.eval_every) and step % cfg.eval_every == 0 and not end
            save_now = bool(cfg.save_every) and step % cfg.save_every == 0 and not end
            if log_now or eval_now or save_now or end or stop.received or step % MAX_UNREAD_STEPS == 0:
                t1 = time.perf_counter()
                read_stats()
                elapsed += time.perf_counter() - t1
                dt += time.perf_counter() - t1
            window_tokens += cfg.tokens_per_batch
            window_time += dt
            tps = window_tokens / max(window_time, 1e-9)
            postfix = f"loss {last_loss:.3f} lr {lr:.2e} {tps:,.0f} tok/s" if last_loss is not None else f"lr {lr:.2e}"
            if time_budget is not None and horizon is None:
                postfix += f" {max(time_budget - elapsed, 0) / 60:.1f} min left"
            bar.update(1, postfix)

            row = None
            if log_now:
                row = {"step": step, "tokens": tokens_seen, "time_s": round(elapsed, 4), "loss": window_loss / window_n,
                       "aux_loss": aux if aux else None, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": round(tps, 1)}
                window_loss, window_n, window_tokens, window_time = 0.0, 0, 0, 0.0
            if eval_now:
                val, val_step = run_eval(), step
                row = (row or {"step": step, "tokens": tokens_seen, "time_s": round(elapsed, 4)}) | _val_fields(val)
                say(f"step {step:>6}  train loss {last_loss:.4f}  {describe_val(val)}")
            if row is not None:
                metrics.write(row)
            if save_now:
                last_ckpt = save(val if val_step == step else None)
                if cfg.plots and env.is_main:
                    plot_metrics(run_dir, title=f"{cfg.preset} ({run_dir.name})", bits_per_byte=tokenizer.bits_per_byte)
        read_stats()  # a signal between the last read and the loop's test
    finally:
        bar.close()
        stop.__exit__(None, None, None)
    if stop.received:
        if step > 0 and (last_ckpt is None or last_ckpt.name != ckpt.step_dir_name(step)):
            last_ckpt = save(val if val_step == step else None)
        metrics.close()
        if cfg.plots and env.is_main and step > 0:
            plot_metrics(run_dir, title=f"{cfg.preset} ({run_dir.name})", bits_per_byte=tokenizer.bits_per_byte)
        # the caller says how it stopped (the command line: one line on stderr)
        return TrainResult(run_dir=run_dir, step=step, tokens=tokens_seen, elapsed_s=elapsed, first_loss=first_loss,
                           last_loss=last_loss, val=val, sample=None, checkpoint=last_ckpt, stopped_by=stop.received)

    # ---- the end: final validation, checkpoint, plots, sample
    if val_step != step and step > 0:
        val, val_step = run_eval(), step
        metrics.write({"step": step, "tokens": tokens_seen, "time_s": round(elapsed, 4)} | _val_fields(val))
    metrics.close()
    if step > 0:
        last_ckpt = save(val)
    if cfg.plots and env.is_main:
        plot_metrics(run_dir, title=f"{cfg.preset} ({run_dir.name})", bits_per_byte=tokenizer.bits_per_byte)
    text = None
    if cfg.objective == "clm" and cfg.sample_tokens > 0 and step > 0 and env.is_main:
        from lintime.generation import GenerationConfig, generate

        # distributed: the sharded / hooked training model is not for one process alone; sample
        # from the checkpoint just written
        sampler = ckpt.load_model(last_ckpt, device).model if env.distributed else model
        was_training = sampler.training
        sampler.eval()
        gen_cfg = GenerationConfig(max_new_tokens=cfg.sample_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                                   seed=cfg.seed)
        prompt = cfg.sample_prompt if cfg.sample_prompt is not None else corpus_prompt(val_ds, tokenizer)
        text = generate(sampler, tokenizer, prompt, gen_cfg)[0].text
        sampler.train(was_training)
        ckpt.atomic_write_text(run_dir / SAMPLE_FILE, prompt + text + "\n")
    summary = f"done: {step} steps, {tokens_seen / 1e6:.2f}M tokens in {elapsed / 60:.1f} min of training"
    if first_loss is not None:
        summary += f"; train loss {first_loss:.3f} -> {last_loss:.3f}"
    say(summary)
    if val is not None:
        say(f"validation: {describe_val(val)} on the validation split's first {val['val_targets']:,} tokens "
            f"(rows of {cfg.context_len}; lintime eval scores whole documents)")
    if text is not None:
        say(f"sample (prompt {prompt!r}, temperature {cfg.temperature:g}):")
        say(prompt + text)
    say(f"saved: {last_ckpt}, metrics.jsonl/.csv, plots{', sample.txt' if text is not None else ''} in {run_dir}")
    return TrainResult(run_dir=run_dir, step=step, tokens=tokens_seen, elapsed_s=elapsed, first_loss=first_loss,
                       last_loss=last_loss, val=val, sample=text, checkpoint=last_ckpt)


def _diverged(run_dir: Path, step: int, loss: float, grad_norm: float, what: str | None = None) -> str:
    """The one line of a diverged run: what happened, the last good checkpoint and how to go on."""
    if what is None:
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
    good = ckpt.list_checkpoints(run_dir)
    if good:
        return (f"training diverged at step {step} ({what}); the last good checkpoint is {good[-1]} "
                f"(--init-from {good[-1]} with a lower --lr goes on from it)")
    return (f"training diverged at step {step} ({what}) before any checkpoint; "
            f"try a lower --lr (the same --name {run_dir.name} starts the run over)")


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


class _NoMetrics:
    """The metrics writer of ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _val_fields(val: dict) -> dict:
    return {k: v for k, v in val.items() if k in ("val_loss", "val_bpb", "val_ppl")}

