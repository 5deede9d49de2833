"""``lintime train``: the flags are :class:`lintime.training.TrainConfig`'s fields (see docs/cli.md)."""

from __future__ import annotations

import dataclasses
import inspect

from lintime.cli import CLIError, command
from lintime.training.config import TrainConfig

_D = TrainConfig()  # the defaults live in one place: the config dataclass
# flag name -> TrainConfig field, where they differ
_FIELD = {"time": "time_minutes", "prompt": "sample_prompt"}
_NOT_CONFIG = ("out", "name", "resume", "progress")


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
    steps: int | None = None,
    tokens: int | None = None,
    time: float | None = None,
    recipe: str = _D.recipe,
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
    device: str = _D.device,
    precision: str = _D.precision,
    compile: bool = _D.compile,
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
    prompt: str = _D.sample_prompt,
    sample_tokens: int = _D.sample_tokens,
    temperature: float = _D.temperature,
    top_k: int = _D.top_k,
    out: str = "runs",
    name: str | None = None,
    resume: str | None = None,
    progress: bool = True,
) -> None:
    """Train a language model with a seed's recipe; with no arguments, a tiny FLASH on the Python
    standard library (byte tokenizer), a few minutes on a laptop CPU.

    Leaves runs/<name>/ with config.json, tokenizer/, checkpoints/, metrics.jsonl/.csv, loss plots
    and sample.txt.  Continue an interrupted run with --resume runs/<name> (same settings; budgets,
    logging and saving flags may change).

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
        steps: stop after this many optimiser steps (default 200 when no budget is given).
        tokens: stop after this many training tokens.
        time: stop after this many minutes of training (wall clock).
        recipe: optimisation recipe: flash (FLASH seed Tables 6-7), vq (Transformer-VQ App. C), gla (GLA seed).
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
        seed: seeds the initialisation, the data order and the MLM masks.
        device: auto (cuda when available), cpu, cuda or cuda:N.
        precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16.
        compile: torch.compile the model.
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
        prompt: prompt of the final sample.
        sample_tokens: tokens to sample at the end (0 = no sample).
        temperature: sampling temperature (0 = greedy).
        top_k: sample from the k most likely tokens only (0 = all).
        out: folder that holds the runs.
        name: run name (default: <preset>-<date>-<time>).
        resume: continue the run in this run folder (or from this step folder).
        progress: show the progress bar.
    """
    fields = {_FIELD.get(k, k): v for k, v in locals().items() if k not in _NOT_CONFIG}
    from lintime.training.trainer import train as run_training

    if resume is not None:
        config = _resume_config(resume, fields)
    else:
        config = TrainConfig(**fields)
    try:
        run_training(config, out=out, name=name, resume=resume, progress=progress)
    except KeyboardInterrupt:
        raise
    except RuntimeError as err:
        if "out of memory" in str(err).lower():
            raise CLIError(f"out of memory: lower --micro-batch-tokens or --context-len ({str(err).splitlines()[0]})") from None
        raise


def _resume_config(resume: str, fields: dict) -> TrainConfig:
    """The resumed run's saved config, with the flags that differ from their defaults applied
    (the trainer then refuses those a resumed run cannot change)."""
    from lintime.training import checkpoint as ckpt

    run_dir = ckpt.run_dir_of(ckpt.resolve_checkpoint(resume))
    saved = ckpt.read_run_config(run_dir)
    try:
        base = TrainConfig.from_dict(saved.get("train", {}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot resume: {run_dir}/config.json has an unusable train config ({err})") from None
    defaults = {_FIELD.get(k, k): p.default for k, p in inspect.signature(train).parameters.items() if k not in _NOT_CONFIG}
    changes = {k: v for k, v in fields.items() if v != defaults[k]}
    return dataclasses.replace(base, **changes)

