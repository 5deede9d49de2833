"""The training loop.

:func:`train` runs one :class:`~lintime.training.config.TrainConfig` into a run folder (layout:
:mod:`lintime.training.checkpoint`), or continues one from a checkpoint, in three parts: the set-up
(:func:`lintime.training.run_setup.prepare_run`: run folder, model, optimiser, data, compile choice,
resume), the steps, and the end (final validation, checkpoint, plots, sample, summary).  A step's gradients and
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
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lintime.data import IGNORE_INDEX
from lintime.training import checkpoint as ckpt
from lintime.training import parallel as par
from lintime.training.config import TrainConfig
from lintime.training.graphed import one_sequence_per_row
from lintime.training.metrics import MetricsWriter, plot_metrics
from lintime.training.rng import rng_state
from lintime.training.run_setup import (
    STATE_FORMAT,
    Run,
    check_resume_compatible,
    default_run_name,
    prepare_run,
    without_checkpoint,
)
from lintime.training.runguard import StopSignals
from lintime.training.schedule import lr_at_progress, lr_at_step
from lintime.training.step import StepStats, describe_val, evaluate, forward_backward

__all__ = ["TrainResult", "check_resume_compatible", "corpus_prompt", "default_run_name", "train", "without_checkpoint"]

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
STEADY_AFTER = 5  # the summary's speed leaves out a process's first steps: they hold the capture and compilation


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


def _train(cfg: TrainConfig, env, *, out, name, resume, progress, echo, stop_after, guards) -> TrainResult:
    """:func:`train` in one process of ``env`` (:class:`lintime.training.parallel.DistEnv`): the set-up
    (:func:`lintime.training.run_setup.prepare_run`), the steps, then the end (or the stop by a signal);
    ``guards`` (an ``ExitStack``) holds the run folder's lock until the caller leaves it."""
    say = echo or (lambda line: None)
    run = prepare_run(cfg, env, out=out, name=name, resume=resume, progress=progress, say=say, guards=guards)
    loop = _Loop(run, progress=progress, stop_after=stop_after, say=say)
    loop.run_steps()
    if loop.stop.received:
        return loop.stopped()  # the caller says how it stopped (the command line: one line on stderr)
    return loop.finish()


# ---------------------------------------------------------------------------------------------
# the loop


class _Loop:
    """The steps of a prepared :class:`~lintime.training.run_setup.Run` (which holds the step, tokens and
    elapsed time, updated here), with the numbers the trainer keeps between them: the loss window since the
    last logged step, the last validation and checkpoint, the steps' statistics not read yet."""

    def __init__(self, run: Run, *, progress: bool, stop_after: int | None, say):
        self.run, self.say, self.stop_after = run, say, stop_after
        resume_step = run.step if run.resumed else (0 if run.restarted else None)  # drop rows after it
        self.metrics = (MetricsWriter(run.run_dir, resume_step=resume_step, tensorboard=run.cfg.tensorboard)
                        if run.env.is_main else _NoMetrics())
        self.bar = _Bar(run.horizon, run.step, progress, unit="step")
        self.taken = 0
        self.first_loss = self.last_loss = None
        self.last_lr = run.cfg.lr
        self.val: dict | None = None
        self.val_step = -1
        self.last_ckpt: Path | None = None
        self.window_loss, self.window_n, self.window_tokens, self.window_time = 0.0, 0, 0, 0.0
        # this process's tokens and seconds after its first STEADY_AFTER steps (capture, compilation): the summary's speed
        self.steady_tokens, self.steady_time = 0, 0.0
        # the steps' numbers stay on the device until a logged step (or eval, save, the end) reads them
        self.stats = StepStats(run.env.device, shares=run.env.distributed)  # the graph's data-parallel losses too
        self.loss = self.aux = self.grad_norm = None  # of the last step read
        # a signal stops one process alone; under torchrun the launcher stops every rank
        self.stop = StopSignals()

    def done(self) -> bool:
        run = self.run
        if run.horizon is not None and run.step >= run.horizon:
            return True
        if run.time_budget is not None and run.elapsed >= run.time_budget:
            return True
        return self.stop_after is not None and self.taken >= self.stop_after

    def save(self, val: dict | None) -> Path:
        run, env = self.run, self.run.env
        # never save a diverged model (sharded parameters are checked through the loss only)
        if not env.distributed and not all(bool(torch.isfinite(p).all()) for p in run.model.parameters()):
            raise ValueError(_diverged(run.run_dir, run.step, float("nan"), float("nan"), "the weights hold NaN or infinity"))
        cfg = run.cfg
        trainer_state = {
            "format": STATE_FORMAT,
            "step": run.step,
            "tokens": run.tokens,
            "elapsed_s": run.elapsed,
            "optimizer": ckpt.DCP_MARK if env.distributed else run.opt.state_dict(),
            "scheduler": {"kind": cfg.decay, "horizon_steps": run.horizon, "time_budget_s": run.time_budget,
                          "lr": self.last_lr},
            "data": run.train_it.state_dict(),
            "rng": rng_state(),
            "val": val or {},
        }
        if env.distributed:
            run_dir = run.run_dir
            saved_to = ckpt.save_distributed_checkpoint(run_dir, run.step, run.model, run.opt, trainer_state,
                                                        keep=cfg.keep, abandon=run.abandoned,
                                                        build=lambda: ckpt.build_model(ckpt.read_run_config(run_dir)))
        else:
            saved_to = ckpt.save_checkpoint(run.run_dir, run.step, run.model, trainer_state, keep=cfg.keep,
                                            abandon=run.abandoned)
        run.abandoned.clear()  # the first save sets them aside
        return saved_to

    def run_eval(self) -> dict:
        run, cfg = self.run, self.run.cfg
        out = evaluate(run.eval_model, run.val_ds, context_len=cfg.context_len, rows=cfg.rows_per_micro_batch,
                       max_tokens=cfg.eval_tokens, objective=cfg.objective, seed=cfg.seed,
                       mlm_prob=cfg.mlm_prob, autocast=run.amp, tokenizer=run.tokenizer)
        if run.env.distributed and cfg.parallel == "fsdp":
            par.reshard(run.model)  # a forward without backward leaves the root unsharded (a full copy)
        if not math.isfinite(out["val_loss"]):
            raise ValueError(_diverged(run.run_dir, run.step, out["val_loss"], 0.0, f"the validation loss is {out['val_loss']}"))
        return out

    def read_stats(self) -> None:
        for at, loss, aux, grad_norm in self.stats.read():  # one host read: waits for the queued steps
            self.loss, self.aux, self.grad_norm = loss, aux, grad_norm
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise ValueError(_diverged(self.run.run_dir, at, loss, grad_norm))
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.last_loss = loss
            self.window_loss += loss
            self.window_n += 1

    def plot(self) -> None:
        run = self.run
        plot_metrics(run.run_dir, title=f"{run.cfg.preset} ({run.run_dir.name})",
                     bits_per_byte=run.tokenizer.bits_per_byte)

    def run_steps(self) -> None:
        """Step until the budget, ``stop_after`` or a signal ends the run."""
        if not self.run.env.distributed:
            self.stop.__enter__()
        try:
            while not (self.done() or self.stop.received):
                self._one_step()
            self.read_stats()  # a signal between the last read and the loop's test
        finally:
            self.bar.close()
            self.stop.__exit__(None, None, None)

    def _lr(self) -> float:
        run, cfg = self.run, self.run.cfg
        if run.horizon is not None:
            return lr_at_step(run.step, run.horizon, peak=cfg.lr, warmup=cfg.warmup, decay=cfg.decay,
                              final_lr_ratio=cfg.final_lr_ratio)
        return lr_at_progress(run.elapsed / run.time_budget, peak=cfg.lr, warmup=cfg.warmup, decay=cfg.decay,
                              final_lr_ratio=cfg.final_lr_ratio)

    def _optimizer_step(self, batch, lr: float) -> None:
        """One step on ``batch`` at rate ``lr``: the graph's replay, else forward / backward, gradient
        reduction, clipping and the optimiser; its numbers stay on the device (:attr:`stats`)."""
        run, cfg, env = self.run, self.run.cfg, self.run.env
        graphed = run.graphed
        out = (graphed.step(batch.input_ids, batch.targets, lr, cu_seqlens=batch.cu_seqlens if graphed.packed else None)
               if graphed is not None else None)
        if out is not None:  # the graph took the optimizer step
            self.stats.add(run.step + 1, out.loss, out.aux, out.grad_norm)
            return
        for group in run.opt.param_groups:
            group["lr"] = lr
        # distributed: the predicted tokens of the global batch, summed on the device (no host read)
        n_global = par.global_count(int((batch.targets != IGNORE_INDEX).sum()), env) if env.distributed else None
        step_loss, step_aux = forward_backward(
            run.fwd_model, batch, micro_rows=run.micro_local, aux_weight=cfg.aux_weight, autocast=run.amp,
            n_targets=n_global, replicas=env.world,
            loss_scale=float(env.world) if env.distributed and cfg.parallel != "none" else 1.0,
            context=run.context, fused_loss=cfg.fused, to_host=False)
        par.finish_grads(run.model, env, cfg.parallel)
        norm = par.clip_grad_norm(run.model, cfg.clip if cfg.clip > 0 else math.inf, to_host=False)
        run.opt_step()  # a non-finite step is caught when read, before any checkpoint or evaluation
        run.opt.zero_grad(set_to_none=True)
        self.stats.add(run.step + 1, step_loss, step_aux, norm)

    def _one_step(self) -> None:
        """One step and what follows it: the read of the steps' numbers, the progress bar, and on the
        steps that have them the metrics row, the validation and the checkpoint."""
        run, cfg = self.run, self.run.cfg
        t0 = time.perf_counter()
        batch = next(run.train_it)
        batch = one_sequence_per_row(batch) if cfg.packing == "rows" else batch
        lr = self._lr()
        self._optimizer_step(batch, lr)
        run.step += 1
        self.taken += 1
        run.tokens += cfg.tokens_per_batch
        self.last_lr = lr
        dt = time.perf_counter() - t0  # host time: the device catches up at the next read
        run.elapsed += dt
        end = self.done()
        step = run.step
        log_now = bool(cfg.log_every) and step % cfg.log_every == 0
        eval_now = bool(cfg.eval_every) and step % cfg.eval_every == 0 and not end
        save_now = bool(cfg.save_every) and step % cfg.save_every == 0 and not end
        if log_now or eval_now or save_now or end or self.stop.received or step % MAX_UNREAD_STEPS == 0:
            t1 = time.perf_counter()
            self.read_stats()
            run.elapsed += time.perf_counter() - t1
            dt += time.perf_counter() - t1
        self.window_tokens += cfg.tokens_per_batch
        self.window_time += dt
        if self.taken > STEADY_AFTER:
            self.steady_tokens += cfg.tokens_per_batch
            self.steady_time += dt
        tps = self.window_tokens / max(self.window_time, 1e-9)
        last_loss = self.last_loss
        postfix = f"loss {last_loss:.3f} lr {lr:.2e} {tps:,.0f} tok/s" if last_loss is not None else f"lr {lr:.2e}"
        if run.time_budget is not None and run.horizon is None:
            postfix += f" {max(run.time_budget - run.elapsed, 0) / 60:.1f} min left"
        self.bar.update(1, postfix)

        row = None
        if log_now:
            row = {"step": step, "tokens": run.tokens, "time_s": round(run.elapsed, 4),
                   "loss": self.window_loss / self.window_n, "aux_loss": self.aux if self.aux else None, "lr": lr,
                   "grad_norm": self.grad_norm, "tokens_per_s": round(tps, 1)}
            self.window_loss, self.window_n, self.window_tokens, self.window_time = 0.0, 0, 0, 0.0
        if eval_now:
            self.val, self.val_step = self.run_eval(), step
            row = (row or {"step": step, "tokens": run.tokens, "time_s": round(run.elapsed, 4)}) | _val_fields(self.val)
            self.say(f"step {step:>6}  train loss {self.last_loss:.4f}  {describe_val(self.val)}")
        if row is not None:
            self.metrics.write(row)
        if save_now:
            self.last_ckpt = self.save(self.val if self.val_step == step else None)
            if cfg.plots and run.env.is_main:
                self.plot()

    # ------------------------------------------------------------------ the end

    def stopped(self) -> TrainResult:
        """A run stopped by a signal: its checkpoint at the current step, the metrics closed and plotted."""
        run = self.run
        if run.step > 0 and (self.last_ckpt is None or self.last_ckpt.name != ckpt.step_dir_name(run.step)):
            self.last_ckpt = self.save(self.val if self.val_step == run.step else None)
        self.metrics.close()
        if run.cfg.plots and run.env.is_main and run.step > 0:
            self.plot()
        return TrainResult(run_dir=run.run_dir, step=run.step, tokens=run.tokens, elapsed_s=run.elapsed,
                           first_loss=self.first_loss, last_loss=self.last_loss, val=self.val, sample=None,
                           checkpoint=self.last_ckpt, stopped_by=self.stop.received)

    def finish(self) -> TrainResult:
        """The end of a run: the final validation, checkpoint, plots and sample, and the summary lines."""
        run, cfg, say = self.run, self.run.cfg, self.say
        step = run.step
        if self.val_step != step and step > 0:
            self.val, self.val_step = self.run_eval(), step
            self.metrics.write({"step": step, "tokens": run.tokens, "time_s": round(run.elapsed, 4)}
                               | _val_fields(self.val))
        self.metrics.close()
        if step > 0:
            self.last_ckpt = self.save(self.val)
        if cfg.plots and run.env.is_main:
            self.plot()
        prompt, text = self._sample() if cfg.objective == "clm" and cfg.sample_tokens > 0 and step > 0 and run.env.is_main \
            else (None, None)
        summary = f"done: {step} steps, {run.tokens / 1e6:.2f}M tokens in {run.elapsed / 60:.1f} min of training"
        if self.steady_time > 0:
            summary += f" ({self.steady_tokens / self.steady_time:,.0f} tokens/s after the first {STEADY_AFTER} steps)"
        if self.first_loss is not None:
            summary += f"; train loss {self.first_loss:.3f} -> {self.last_loss:.3f}"
        say(summary)
        if self.val is not None:
            say(f"validation: {describe_val(self.val)} on the validation split's first {self.val['val_targets']:,} tokens "
                f"(rows of {cfg.context_len}; lintime eval scores whole documents)")
        if text is not None:
            say(f"sample (prompt {prompt!r}, temperature {cfg.temperature:g}):")
            say(prompt + text)
        say(f"saved: {self.last_ckpt}, metrics.jsonl/.csv, plots{', sample.txt' if text is not None else ''} in "
            f"{run.run_dir}")
        return TrainResult(run_dir=run.run_dir, step=step, tokens=run.tokens, elapsed_s=run.elapsed,
                           first_loss=self.first_loss, last_loss=self.last_loss, val=self.val, sample=text,
                           checkpoint=self.last_ckpt)

    def _sample(self) -> tuple[str, str]:
        """``(prompt, text)``: a sample of the trained model, also written to ``sample.txt``."""
        from lintime.generation import GenerationConfig, generate

        run, cfg = self.run, self.run.cfg
        # distributed: the sharded / hooked training model is not for one process alone; sample
        # from the checkpoint just written
        sampler = ckpt.load_model(self.last_ckpt, run.env.device).model if run.env.distributed else run.model
        was_training = sampler.training
        sampler.eval()
        gen_cfg = GenerationConfig(max_new_tokens=cfg.sample_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                                   seed=cfg.seed)
        prompt = cfg.sample_prompt if cfg.sample_prompt is not None else corpus_prompt(run.val_ds, run.tokenizer)
        text = generate(sampler, run.tokenizer, prompt, gen_cfg)[0].text
        sampler.train(was_training)
        ckpt.atomic_write_text(run.run_dir / SAMPLE_FILE, prompt + text + "\n")
        return prompt, text


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


class _NoMetrics:
    """The metrics writer of ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _val_fields(val: dict) -> dict:
    return {k: v for k, v in val.items() if k in ("val_loss", "val_bpb", "val_ppl")}
