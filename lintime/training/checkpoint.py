"""Run folders and checkpoints: the one on-disk contract shared by ``train``, ``eval`` and ``generate``.

Layout of a run folder::

    runs/<name>/config.json          {"model": ModelConfig.to_dict(), "objective": "clm" | "mlm",
                                      "tokenizer": tokenizer.name, "train": TrainConfig as a dict,
                                      "lintime_version": "..."}
    runs/<name>/tokenizer/           tokenizer.save(dir)  (load_tokenizer(dir) reads it back)
    runs/<name>/checkpoints/step_00000100/model.safetensors   weights (float32, tied tensors stored once)
    runs/<name>/checkpoints/step_00000100/trainer_state.pt    optimizer, scheduler, data iterator,
                                      RNG states, step, tokens seen, elapsed time; plain containers and
                                      tensors only: ``torch.load(path, weights_only=True)`` reads it
    runs/<name>/checkpoints/step_00000100/checksums.json      sha256 of the two files above, checked at
                                      load (with a finite-values check of the weights): a corrupted
                                      checkpoint is refused, naming the run's newest intact one
    runs/<name>/checkpoints/latest   text file: the name of the newest step folder ("step_00000100")
    runs/<name>/checkpoints/abandoned/step_00000300/   an intact step folder set aside by a resume
                                      from an earlier step (see "Keep, corrupted, abandoned" below)

Distributed runs (``torchrun``, :mod:`lintime.training.parallel`) write the same folder, plus
the optimizer's shards::

    runs/<name>/checkpoints/step_00000100/optimizer/  torch.distributed.checkpoint (DCP) of the
                                      optimizer state, sharded as trained; DCP re-shards it on load,
                                      so a run resumes on any number of processes (or on one)

``model.safetensors`` is still the full fp32 model (gathered on rank 0), so :func:`load_model`,
``lintime eval / generate`` and the HF export read distributed runs unchanged, and the
``optimizer`` entry of ``trainer_state.pt`` is the string ``"dcp"``.

Atomicity: every file is written to a temporary file beside it, flushed, fsynced and renamed; a
step folder is written whole under a hidden temporary name (``.tmp-step_...``), fsynced, then
renamed to ``step_NNNNNNNN``, and only then does ``latest`` move to it and are old step folders
pruned.  A crash at any point leaves the previous checkpoint complete and ``latest`` naming a
complete folder; hidden temporary folders are ignored by readers and removed by the next save.
Files and folders get the modes of ordinary ones (``0o666 / 0o777 & ~umask``), not the private
modes of ``tempfile`` (:func:`lintime.utils.io.ordinary_mode`).

Keep, corrupted, abandoned: ``keep=N`` keeps the ``N`` newest *intact* step folders (their files
match ``checksums.json``) and deletes the older ones and every corrupted one, so a corrupted
folder never takes an intact one's place.  A run resumed from a step folder older than the
run's newest continues from that step: the later step folders belong to an abandoned future;
its first save deletes the corrupted ones among them and moves the intact ones to
``checkpoints/abandoned/`` (:func:`later_checkpoints`, the ``abandon`` argument of
:func:`save_checkpoint`).  :func:`resolve_checkpoint` of a run folder whose ``latest`` is corrupted
gives the newest intact step folder before it (``load_model`` instead refuses, naming it).

Entry points: :func:`write_run_config` (once per run), :func:`save_checkpoint` (every
``--save-every`` steps), :func:`load_model` (eval / generate / sample), :func:`resolve_checkpoint`
and :func:`load_trainer_state` (resume).  This module holds them and names every public piece;
the step folders' handling (names, checksums, publishing, retention) is in
:mod:`lintime.training.checkpoint_folders`, the distributed checkpoints in
:mod:`lintime.training.checkpoint_sharded`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lintime import __version__
from lintime.data import DataError, load_tokenizer
from lintime.models import CausalLM, MaskedLM, ModelConfig
from lintime.training.checkpoint_folders import (
    _STEP_DIR,
    ABANDONED_DIR,
    CHECKPOINTS_DIR,
    CHECKSUM_FILE,
    CONFIG_FILE,
    DCP_MARK,
    LATEST_FILE,
    OPTIM_DIR,
    STATE_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    _corrupted,
    _one_line,
    _prune,
    _publish,
    _remove_stale_temporaries,
    _set_aside,
    _write_weights_and_state,
    abandon_notice,
    file_sha256,
    later_checkpoints,
    list_checkpoints,
    newest_intact_checkpoint,
    resolve_checkpoint,
    run_dir_of,
    step_dir_name,
    verify_checkpoint,
)
from lintime.training.checkpoint_sharded import (
    load_sharded_optimizer,
    optimizer_state_by_name,
    save_distributed_checkpoint,
    set_optimizer_by_name,
)
from lintime.utils.io import atomic_write_json, atomic_write_text, fsync_dir, temp_dir

__all__ = [
    "ABANDONED_DIR", "CHECKPOINTS_DIR", "CHECKSUM_FILE", "CONFIG_FILE", "DCP_MARK", "LATEST_FILE", "OPTIM_DIR",
    "STATE_FILE", "TOKENIZER_DIR", "WEIGHTS_FILE", "LoadedModel", "abandon_notice", "atomic_write_text",
    "build_model", "file_sha256", "later_checkpoints", "list_checkpoints", "load_model", "load_sharded_optimizer",
    "load_trainer_state", "load_weights", "newest_intact_checkpoint", "nonfinite_tensors",
    "optimizer_state_by_name", "read_run_config", "resolve_checkpoint", "run_dir_of", "save_checkpoint",
    "save_distributed_checkpoint", "set_optimizer_by_name", "step_dir_name", "verify_checkpoint", "write_run_config",
]


# ---------------------------------------------------------------------------------------------
# writing


def write_run_config(
    run_dir: str | os.PathLike,
    *,
    model_config,
    objective: str,
    tokenizer,
    train: dict,
) -> dict:
    """Write ``config.json`` and ``tokenizer/`` of a run (atomically); return the config dict."""
    if objective not in ("clm", "mlm"):
        raise ValueError(f"objective must be 'clm' or 'mlm', got {objective!r}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "model": model_config.to_dict(),
        "objective": objective,
        "tokenizer": tokenizer.name,
        "train": train,
        "lintime_version": __version__,
    }
    tok_dir = run_dir / TOKENIZER_DIR
    if not tok_dir.is_dir():
        tmp = temp_dir(run_dir, f".{TOKENIZER_DIR}.tmp-")
        try:
            tokenizer.save(tmp)
            os.rename(tmp, tok_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_json(run_dir / CONFIG_FILE, config)
    return config


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    trainer_state: dict,
    *,
    keep: int = 0,
    abandon: list[Path] | tuple[Path, ...] = (),
) -> Path:
    """Write ``checkpoints/step_<step>/`` (weights + trainer state) atomically, point ``latest`` at
    it, then delete all but the newest ``keep`` intact step folders, and every corrupted one
    (``keep=0`` keeps all).

    ``abandon``: step folders of an abandoned future (:func:`later_checkpoints` of the step folder
    a run resumed from; pass them to the resumed run's first save only): before the new folder
    is published, the corrupted ones are deleted and the intact ones moved to
    ``checkpoints/abandoned/``.

    ``model`` is the plain module (not a ``torch.compile`` wrapper: its parameter names must be
    the model's own).  ``trainer_state`` holds only tensors, numbers, strings, lists and dicts.
    Returns the step folder.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {keep}")
    ckpt_root = Path(run_dir) / CHECKPOINTS_DIR
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(ckpt_root)
    final = ckpt_root / step_dir_name(step)
    tmp = temp_dir(ckpt_root, f".tmp-{final.name}-")
    try:
        _write_weights_and_state(tmp, model, step, trainer_state)
        _set_aside(abandon, ckpt_root)
        _publish(tmp, final, ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(ckpt_root)
    atomic_write_text(ckpt_root / LATEST_FILE, final.name + "\n")
    if keep:
        _prune(run_dir, keep, final)
    return final


# ---------------------------------------------------------------------------------------------
# reading


def read_run_config(run_dir: str | os.PathLike) -> dict:
    """``config.json`` of a run, checked for the keys every reader needs."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"run config not found: {path}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"run config {path} is not valid JSON ({err})") from None
    missing = [k for k in ("model", "objective", "tokenizer") if k not in config]
    if missing:
        raise ValueError(f"run config {path} lacks {', '.join(missing)}: not a lintime run folder")
    if config["objective"] not in ("clm", "mlm"):
        raise ValueError(f"run config {path}: unknown objective {config['objective']!r}")
    return config


def build_model(config: dict, *, initialise: bool = True) -> nn.Module:
    """A fresh ``CausalLM`` / ``MaskedLM`` from a run config dict (``config.json``).  ``initialise=False``: the
    parameters are left as allocated (``torch.nn.init``'s functions do nothing while the model is built), for a
    strict load that overwrites every one of them (:func:`load_weights`); buffers are built as always."""
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"the run's model config cannot be built here: {_one_line(err)}") from None
    cls = CausalLM if config["objective"] == "clm" else MaskedLM
    if initialise:
        return cls(model_config)
    with _init_skipped():
        return cls(model_config)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")
_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _init_skipped():
    """``torch.nn.init``'s functions return their tensor untouched inside the block (a model whose weights a load
    replaces need not draw them: the random draws cost more than the load)."""
    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
        try:
            for name in saved:
                setattr(nn.init, name, _keep)
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def _keep(tensor, *args, **kwargs):
    return tensor


def load_weights(model: nn.Module, step_dir: str | os.PathLike, device: str | torch.device = "cpu", *,
                 checked: Future | None = None) -> None:
    """Load ``model.safetensors`` of ``step_dir`` into ``model`` (strict: every name and shape must
    match); a mismatch raises ``ValueError`` with one line naming the first differences.  The file
    must match the checksum recorded at save and every loaded value must be finite, else
    ``ValueError`` says the checkpoint is corrupted and names the run's newest intact one.
    ``checked``: the checksum comparison of the weights, already started (:func:`load_model`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model as st_load_model

    path = Path(step_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"weights not found: {path}")
    problem = checked.result() if checked is not None else verify_checkpoint(step_dir, (WEIGHTS_FILE,))
    if problem is not None:
        raise _corrupted(Path(step_dir), problem)
    try:
        missing, unexpected = st_load_model(model, str(path), strict=False, device=str(device))
    except RuntimeError as err:  # size mismatch
        shapes = re.findall(r"size mismatch for ([\w.]+)", str(err))
        detail = f"shape mismatch for {', '.join(shapes[:3])}" if shapes else _one_line(err)
        raise ValueError(f"checkpoint {path} does not fit this model: {detail}") from None
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint {path} is unreadable: {_one_line(err)}") from None
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {', '.join(sorted(missing)[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(sorted(unexpected)[:3])})")
        raise ValueError(f"checkpoint {path} does not fit this model: {'; '.join(parts)} tensors")
    bad = nonfinite_tensors(model)
    if bad:
        raise _corrupted(Path(step_dir), f"{len(bad)} tensor(s) of {WEIGHTS_FILE} hold NaN or infinity (e.g. {bad[0]})")


def nonfinite_tensors(model: nn.Module) -> list[str]:
    """Names, in ``state_dict`` order, of the floating-point tensors of ``model`` that hold NaN or infinity:
    a min and max per tensor (NaN propagates through both) and one read of the results on the host."""
    named = [(name, t) for name, t in model.state_dict().items() if t.is_floating_point() and t.numel()]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(torch.stack(torch.aminmax(t))).all() for _, t in named]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def load_trainer_state(step_dir: str | os.PathLike) -> dict:
    """``trainer_state.pt`` of ``step_dir`` (``torch.load(..., weights_only=True)``)."""
    path = Path(step_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"trainer state not found: {path}")
    problem = verify_checkpoint(step_dir, (STATE_FILE,))
    if problem is not None:
        raise _corrupted(Path(step_dir), problem)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file raises several kinds of errors
        raise ValueError(f"trainer state {path} is unreadable: {_one_line(err)}") from None


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread (an early error exit does not wait for it); its result or exception in the
    returned future."""
    done: Future = Future()

    def run():
        try:
            done.set_result(fn(*args))
        except BaseException as err:
            done.set_exception(err)

    threading.Thread(target=run, name="lintime-checksum", daemon=True).start()
    return done


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: the model (eval mode), its tokenizer, the run's
    ``config.json`` as a dict, and the checkpoint's step."""

    model: nn.Module
    tokenizer: Any
    config: dict
    step: int


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a trained model from a run folder (its ``latest`` checkpoint) or a step folder.

    Returns :class:`LoadedModel` with the model on ``device`` in eval mode.  A missing folder or
    file raises ``FileNotFoundError``, an incompatible or unreadable checkpoint ``ValueError``;
    both with a one-line message (the CLI prints it and exits 2).
    """
    step_dir = resolve_checkpoint(path, intact=False)
    run_dir = run_dir_of(step_dir)
    config = read_run_config(run_dir)
    try:
        tokenizer = load_tokenizer(run_dir / TOKENIZER_DIR)
    except DataError as err:
        raise FileNotFoundError(str(err)) from None
    if tokenizer.name != config["tokenizer"]:
        raise ValueError(f"run {run_dir}: tokenizer/ is {tokenizer.name!r} but config.json says {config['tokenizer']!r}")
    checked = _in_background(verify_checkpoint, step_dir, (WEIGHTS_FILE,))  # hashing the file overlaps the build
    model = build_model(config, initialise=False)  # load_weights overwrites every parameter (strict)
    load_weights(model, step_dir, checked=checked)
    model.to(device).eval()
    m = _STEP_DIR.match(step_dir.name)
    step = int(m.group(1)) if m else -1
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, step=step)
