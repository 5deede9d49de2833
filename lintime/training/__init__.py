"""Training: the run-folder / checkpoint contract (:mod:`lintime.training.checkpoint`), the
training config and the seeds' recipes (:mod:`~lintime.training.config`), learning-rate
schedules, the training loop (:mod:`~lintime.training.trainer`), metrics and plots.
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
from lintime.training.trainer import TrainResult, evaluate, forward_backward, train

__all__ = [
    "RECIPES",
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
