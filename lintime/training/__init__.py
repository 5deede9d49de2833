"""Training: the run-folder / checkpoint contract (:mod:`lintime.training.checkpoint`), the
training config and the seeds' recipes (:mod:`~lintime.training.config`), learning-rate
schedules, one step and validation (:mod:`~lintime.training.step`), the step captured in one CUDA graph
(:mod:`~lintime.training.graphed`), the training loop
(:mod:`~lintime.training.trainer`), distributed training (:mod:`~lintime.training.parallel`),
metrics and plots.
No CLI code here (``lintime train`` is :mod:`lintime.cli.train`)."""

from lintime.training.checkpoint import (
    LoadedModel,
    list_checkpoints,
    load_model,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
    write_run_config,
)
from lintime.training.config import RECIPES, Recipe, TrainConfig
from lintime.training.graphed import GraphedStep
from lintime.training.step import evaluate, forward_backward
from lintime.training.trainer import TrainResult, train

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
