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
and :func:`load_trainer_state` (resume).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lintime import __version__
from lintime.data import DataError, load_tokenizer
from lintime.models import CausalLM, MaskedLM, ModelConfig
from lintime.training.parallel import reshard
from lintime.utils.io import atomic_write_json, atomic_write_text, fsync_dir, fsync_file, ordinary_mode, temp_dir

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CHECKSUM_FILE = "checksums.json"  # {"sha256": {file name: hex digest}} of the step folder's files
OPTIM_DIR = "optimizer"
ABANDONED_DIR = "abandoned"  # checkpoints/abandoned/: intact step folders a resume from an earlier step set aside
DCP_MARK = "dcp"  # trainer_state["optimizer"] of a distributed checkpoint
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """``step_00000100`` (8 digits, zero-padded, so names sort like steps)."""
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------
# step folders: written whole, then published by a rename


def _publish(tmp: Path, final: Path, ckpt_root: Path) -> None:
    """Move the finished temporary folder ``tmp`` to ``final``; re-saving a step (e.g. after a
    resume) swaps the folders, so a reader never sees a half-written state."""
    ordinary_mode(tmp)
    fsync_dir(tmp)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=ckpt_root))
        os.rename(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _write_weights_and_state(folder: Path, model: torch.nn.Module, step: int, trainer_state: dict) -> None:
    """``model.safetensors``, ``trainer_state.pt`` and their ``checksums.json`` into ``folder``,
    each fsynced.  A failed write (a full disk) raises ``OSError`` naming the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    weights, state = folder / WEIGHTS_FILE, folder / STATE_FILE
    try:
        save_model(model, str(weights), metadata={"format": "lintime", "step": str(step)})
        ordinary_mode(weights)  # safetensors writes through a private (0600) temporary file
        fsync_file(weights)
        with open(state, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
    except (RuntimeError, SafetensorError) as err:  # how torch.save / safetensors report a failed write
        raise _write_error(folder, err) from None
    atomic_write_json(folder / CHECKSUM_FILE, {"sha256": {WEIGHTS_FILE: file_sha256(weights), STATE_FILE: file_sha256(state)}})


def _write_error(folder: Path, err: BaseException) -> OSError:
    """``err`` of a library's failed write as the ``OSError`` it hides: the errno it names
    (``os error 28``), else ENOSPC when the disk is full, else EIO."""
    found = re.search(r"os error (\d+)", str(err))
    if found:
        code = int(found.group(1))
    else:
        try:
            code = errno.ENOSPC if shutil.disk_usage(folder).free < (1 << 20) else errno.EIO
        except OSError:
            code = errno.EIO
    return OSError(code, f"{os.strerror(code)} (writing a checkpoint: {_one_line(err)})", str(folder))


_DIGESTS: dict[tuple, str] = {}  # file identity and stat -> sha256, so pruning does not re-hash every save


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file; remembered for the file as it is (device, inode, size, mtime and ctime
    in ns: any write or replacement changes them), so a process hashes a checkpoint once."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == key[2:]:  # not written while read
        if len(_DIGESTS) >= 256:
            _DIGESTS.clear()
        _DIGESTS[key] = digest
    return digest


def verify_checkpoint(step_dir: str | os.PathLike, files: tuple[str, ...] = (WEIGHTS_FILE, STATE_FILE)) -> str | None:
    """``None`` when ``files`` of ``step_dir`` match the checksums recorded at save, else what is
    wrong (one phrase).  A checkpoint saved before checksums existed has none to check: ``None``."""
    step_dir = Path(step_dir)
    try:
        recorded = json.loads((step_dir / CHECKSUM_FILE).read_text())["sha256"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {CHECKSUM_FILE} is unreadable"
    for name in files:
        if name in recorded and (not (step_dir / name).is_file() or file_sha256(step_dir / name) != recorded[name]):
            return f"{name} does not match the checksum recorded when it was saved"
    return None


def newest_intact_checkpoint(run_dir: str | os.PathLike, *, besides: Path | None = None) -> Path | None:
    """The newest step folder of ``run_dir`` (other than ``besides``) whose files match their checksums."""
    for cand in reversed(list_checkpoints(run_dir)):
        if besides is not None and cand.resolve() == Path(besides).resolve():
            continue
        if verify_checkpoint(cand) is None:
            return cand
    return None


def _corrupted(step_dir: Path, what: str) -> ValueError:
    step_dir = Path(step_dir)
    good = newest_intact_checkpoint(run_dir_of(step_dir), besides=step_dir) if _STEP_DIR.match(step_dir.name) else None
    hint = f"; the newest intact checkpoint is {good}" if good is not None else "; the run has no other intact checkpoint"
    return ValueError(f"checkpoint {step_dir} is corrupted: {what}{hint}")


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


def _prune(run_dir: str | os.PathLike, keep: int, newest: Path) -> None:
    """Keep the ``keep`` newest intact step folders (``newest``, just written, is one); delete the
    older ones and every corrupted one, which never counts among the ``keep``."""
    kept = 0
    for cand in reversed(list_checkpoints(run_dir)):
        if kept < keep and (cand == newest or verify_checkpoint(cand) is None):
            kept += 1
        else:
            shutil.rmtree(cand, ignore_errors=True)


def later_checkpoints(step_dir: str | os.PathLike) -> list[Path]:
    """The step folders of ``step_dir``'s run with a later step, oldest first: what a run resumed
    from ``step_dir`` abandons (pass them as ``abandon`` to its first save)."""
    m = _STEP_DIR.match(Path(step_dir).name)
    if m is None:
        return []
    return [p for p in list_checkpoints(run_dir_of(step_dir)) if _step_of(p) > int(m.group(1))]


def abandon_notice(step_dir: str | os.PathLike, later: list[Path]) -> str:
    """The line that tells a user resuming from ``step_dir`` what happens to ``later``."""
    corrupted = {p for p in later if verify_checkpoint(p) is not None}
    names = ", ".join(p.name + (" (corrupted)" if p in corrupted else "") for p in later)
    todo = []
    if corrupted:
        todo.append("deletes the corrupted ones")
    if len(corrupted) < len(later):
        todo.append(f"moves the intact ones to {run_dir_of(step_dir) / CHECKPOINTS_DIR / ABANDONED_DIR}/")
    return (f"lintime train: resuming from {step_dir}: the later {names} belong to an abandoned future; "
            f"the first save {' and '.join(todo)}")


def _set_aside(folders, ckpt_root: Path) -> None:
    """Delete the corrupted step folders of ``folders``, move the intact ones to ``abandoned/``
    (replacing an earlier abandoned folder of the same step)."""
    for old in folders:
        old = Path(old)
        if not old.is_dir():
            continue
        if verify_checkpoint(old) is not None:
            shutil.rmtree(old, ignore_errors=True)
            continue
        dest = ckpt_root / ABANDONED_DIR / old.name
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(old, dest)
    if folders:
        fsync_dir(ckpt_root)


def _step_of(step_dir: Path) -> int:
    return int(_STEP_DIR.match(step_dir.name).group(1))


def save_distributed_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    *,
    build,
    keep: int = 0,
    abandon: list[Path] | tuple[Path, ...] = (),
) -> Path:
    """The distributed form of :func:`save_checkpoint`; every rank calls it (it is collective).

    Rank 0 makes the hidden temporary step folder and tells the others its name; all ranks write
    their optimizer shards into ``optimizer/`` (DCP) and take part in gathering the full model
    state, which rank 0 loads into ``build()`` (a plain model) and writes as ``model.safetensors``
    with ``trainer_state.pt``; then, after a barrier, rank 0 renames the folder into place, moves
    ``latest``, sets ``abandon`` aside and prunes, exactly as :func:`save_checkpoint`.  Returns the
    step folder."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    main = dist.get_rank() == 0
    ckpt_root = Path(run_dir) / CHECKPOINTS_DIR
    final = ckpt_root / step_dir_name(step)
    box = [None]
    if main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(ckpt_root)
        box[0] = str(temp_dir(ckpt_root, f".tmp-{final.name}-"))
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    try:
        dcp.save({"optimizer": _optimizer_tensors(model, optimizer)}, checkpoint_id=str(tmp / OPTIM_DIR))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if main:
            plain = build()
            plain.load_state_dict({k: v.float() for k, v in full.items()})
            _write_weights_and_state(tmp, plain, step, trainer_state)
        del full
        dist.barrier()
        if main:
            _set_aside(abandon, ckpt_root)
            _publish(tmp, final, ckpt_root)
            fsync_dir(ckpt_root)
            atomic_write_text(ckpt_root / LATEST_FILE, final.name + "\n")
            if keep:
                _prune(run_dir, keep, final)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    return final


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{parameter name: {state name: tensor}}`` of an AdamW-like optimizer (every state entry a
    tensor; FSDP2 moments are ``DTensor`` shards, which DCP saves and re-shards by name).  The
    optimizer's state is created (zeros) where a parameter has none yet, so that a fresh
    optimizer offers DCP the tensors to load into.

    FSDP2 modules are resharded first: a module left unsharded (the root after a forward without
    a backward, e.g. a validation pass) reports its full, unsharded tensors as parameters, which
    are not the sharded ones the optimizer holds -- their state would be missed (saved and loaded
    as zeros).  Every parameter must be one of the optimizer's, and every optimizer parameter
    must be named, or this raises ``RuntimeError``."""
    reshard(model)
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    out = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        if id(p) not in owned:
            raise RuntimeError(f"parameter {name} is not a tensor the optimizer holds (an unsharded FSDP module?)")
        seen.add(id(p))
        st = optimizer.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if _fused(optimizer) else "cpu")
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        out[name] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    if len(seen) != len(owned):
        raise RuntimeError(f"{len(owned) - len(seen)} optimizer parameters are not parameters of the model")
    return out


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, step_dir: str | os.PathLike) -> None:
    """Load the DCP optimizer state of a distributed checkpoint into ``optimizer`` (any number of
    processes, including one: DCP re-shards by parameter name)."""
    import torch.distributed.checkpoint as dcp

    path = Path(step_dir) / OPTIM_DIR
    if not path.is_dir():
        raise FileNotFoundError(f"cannot resume: {step_dir} is a distributed checkpoint without its {OPTIM_DIR}/ folder")
    target = _optimizer_tensors(model, optimizer)
    box = {"optimizer": {n: dict(st) for n, st in target.items()}}
    try:
        with warnings.catch_warnings():  # one process, no group: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(box, checkpoint_id=str(path))
    except Exception as err:  # missing keys / shapes: DCP raises several kinds
        raise ValueError(f"cannot resume: the optimizer state in {step_dir} does not fit this model ({_one_line(err)})") from None
    # DCP loads in place where it can, but may hand back new tensors (e.g. 0-D ones): copy them in
    for name, st in target.items():
        for k, t in st.items():
            got = box["optimizer"][name][k]
            if got is not t:
                t.copy_(got)


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict, step_dir) -> dict:
    """A single-process checkpoint's optimizer state (``opt.state_dict()``, keyed by parameter
    index) re-keyed by parameter name, for a distributed resume: ``model`` is the plain model
    and ``optimizer`` a fresh one built on it the same way as the saved one."""
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"cannot resume: the optimizer state in {step_dir} does not fit this model ({_one_line(err)})") from None
    return {name: {k: v.detach().clone() for k, v in st.items()} for name, st in _optimizer_tensors(model, optimizer).items()}


def set_optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full, name-keyed optimizer state (:func:`optimizer_state_by_name`) into the
    optimizer of a wrapped / sharded model (every rank holds the full state; an FSDP2 rank
    keeps its shard of each moment)."""
    target = _optimizer_tensors(model, optimizer)
    for name, st in target.items():
        for k, t in st.items():
            src = state[name][k].to(t.device if not hasattr(t, "device_mesh") else t.to_local().device)
            if hasattr(t, "device_mesh"):  # DTensor shard: take this rank's piece of the full tensor
                from torch.distributed.tensor import distribute_tensor

                t.to_local().copy_(distribute_tensor(src, t.device_mesh, t.placements).to_local())
            else:
                t.copy_(src)


def _remove_stale_temporaries(ckpt_root: Path) -> None:
    """Leftovers of a save that crashed (hidden ``.tmp-`` / ``.old-`` folders)."""
    for p in ckpt_root.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-") or p.name.startswith(".old-")):
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# reading


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete step folders of a run, oldest first (hidden temporaries are not listed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / WEIGHTS_FILE).is_file()]


def resolve_checkpoint(path: str | os.PathLike, *, intact: bool = True) -> Path:
    """The step folder meant by ``path``: a step folder itself, or a run folder (its ``latest``;
    when ``latest`` is missing or names a missing folder, the highest complete step folder).
    With ``intact`` (the default), a run folder's choice that is corrupted (its files do not
    match their checksums) gives way to the newest intact step folder before it, when there is
    one; ``intact=False`` returns it as is (:func:`load_model` does, so that loading refuses it
    in one line naming the intact one rather than silently loading an older model).
    Raises ``FileNotFoundError`` with one line when there is none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / WEIGHTS_FILE).is_file():
        return path
    if _STEP_DIR.match(path.name):
        raise FileNotFoundError(f"checkpoint {path} is incomplete: it has no {WEIGHTS_FILE}")
    if (path / CHECKPOINTS_DIR).is_dir() or (path / CONFIG_FILE).is_file():
        latest = path / CHECKPOINTS_DIR / LATEST_FILE
        found = list_checkpoints(path)
        chosen = found[-1] if found else None
        if latest.is_file():
            cand = path / CHECKPOINTS_DIR / latest.read_text().strip()
            if (cand / WEIGHTS_FILE).is_file():
                chosen = cand
        if chosen is None:
            raise FileNotFoundError(f"run {path} has no checkpoint yet (no {CHECKPOINTS_DIR}/step_* folder)")
        if intact and _STEP_DIR.match(chosen.name) and verify_checkpoint(chosen) is not None:
            before = [p for p in found if _step_of(p) < _step_of(chosen)]
            good = next((p for p in reversed(before) if verify_checkpoint(p) is None), None)
            if good is not None:
                return good
        return chosen
    raise FileNotFoundError(f"{path} is neither a run folder (with {CONFIG_FILE}) nor a checkpoint folder (with {WEIGHTS_FILE})")


def run_dir_of(step_dir: str | os.PathLike) -> Path:
    """The run folder of a step folder (``runs/<name>/checkpoints/step_N`` -> ``runs/<name>``; also
    of one set aside in ``checkpoints/abandoned/``)."""
    parent = Path(step_dir).parent
    if parent.name == ABANDONED_DIR and parent.parent.name == CHECKPOINTS_DIR:
        return parent.parent.parent
    return parent.parent


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


def build_model(config: dict) -> nn.Module:
    """A fresh ``CausalLM`` / ``MaskedLM`` from a run config dict (``config.json``)."""
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"the run's model config cannot be built here: {_one_line(err)}") from None
    return (CausalLM if config["objective"] == "clm" else MaskedLM)(model_config)


def load_weights(model: nn.Module, step_dir: str | os.PathLike, device: str | torch.device = "cpu") -> None:
    """Load ``model.safetensors`` of ``step_dir`` into ``model`` (strict: every name and shape must
    match); a mismatch raises ``ValueError`` with one line naming the first differences.  The file
    must match the checksum recorded at save and every loaded value must be finite, else
    ``ValueError`` says the checkpoint is corrupted and names the run's newest intact one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model as st_load_model

    path = Path(step_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"weights not found: {path}")
    problem = verify_checkpoint(step_dir, (WEIGHTS_FILE,))
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
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise _corrupted(Path(step_dir), f"{len(bad)} tensor(s) of {WEIGHTS_FILE} hold NaN or infinity (e.g. {bad[0]})")


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
    model = build_model(config)
    load_weights(model, step_dir)
    model.to(device).eval()
    m = _STEP_DIR.match(step_dir.name)
    step = int(m.group(1)) if m else -1
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, step=step)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."
