"""Training: the run-folder / checkpoint contract (:mod:`lintime.training.checkpoint`, with its step folders and
retention in :mod:`~lintime.training.checkpoint_folders` and the distributed save in
:mod:`~lintime.training.checkpoint_sharded`), the training config and the seeds' recipes
(:mod:`~lintime.training.config`), learning-rate schedules, one step and validation (:mod:`~lintime.training.step`),
the step captured in one CUDA graph (:mod:`~lintime.training.graphed`), a run's set-up
(:mod:`~lintime.training.run_setup`) and its loop (:mod:`~lintime.training.trainer`), synthetic-task training
(:mod:`~lintime.training.tasks`, :mod:`~lintime.training.task_config`), distributed training
(:mod:`~lintime.training.parallel`, :mod:`~lintime.training.context_parallel`), metrics and plots.
No CLI code here (``lintime train`` is :mod:`lintime.cli.train`)."""

from __future__ import annotations

import importlib

# name -> submodule; imported on first use (PEP 562), so the command line reads TrainConfig's defaults
# without importing torch
_EXPORTS = {
    "LoadedModel": "checkpoint",
    "list_checkpoints": "checkpoint",
    "load_model": "checkpoint",
    "load_trainer_state": "checkpoint",
    "resolve_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "write_run_config": "checkpoint",
    "RECIPES": "config",
    "Recipe": "config",
    "TrainConfig": "config",
    "GraphedStep": "graphed",
    "evaluate": "step",
    "forward_backward": "step",
    "TrainResult": "trainer",
    "train": "trainer",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lintime.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lintime.training.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)


__all__ = [
    "RECIPES",
    "GraphedStep",
    "LoadedModel",
    "Recipe",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "forward_backward",
    "list_checkpoints",
    "load_model",
    "load_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "train",
    "write_run_config",
]
