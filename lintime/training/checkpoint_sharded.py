"""Checkpoints of a distributed run: every rank's optimizer shards and the gathered model.

:func:`save_distributed_checkpoint` is the collective form of
:func:`lintime.training.checkpoint.save_checkpoint` (the same step folder, plus ``optimizer/``:
the optimizer state as ``torch.distributed.checkpoint`` shards, re-sharded on load);
:func:`load_sharded_optimizer` reads it back on any number of processes, and
:func:`optimizer_state_by_name` / :func:`set_optimizer_by_name` carry a single-process
checkpoint's optimizer state into a distributed resume.  The layout is documented in
:mod:`lintime.training.checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from lintime.training.checkpoint_folders import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    OPTIM_DIR,
    _one_line,
    _prune,
    _publish,
    _remove_stale_temporaries,
    _set_aside,
    _write_weights_and_state,
    step_dir_name,
)
from lintime.training.parallel import reshard
from lintime.utils.io import atomic_write_text, fsync_dir, temp_dir


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
