"""Training: the run-folder / checkpoint contract (:mod:`lintime.training.checkpoint`), the
training config and recipes, the training loop, metrics and plots.  No CLI code here."""

from lintime.training.checkpoint import (
    LoadedModel,
    list_checkpoints,
    load_model,
    load_trainer_state,
    resolve_checkpoint,
    save_checkpoint,
    write_run_config,
)

__all__ = [
    "LoadedModel",
    "list_checkpoints",
    "load_model",
    "load_trainer_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "write_run_config",
]
