"""RNG state of a run (torch, NumPy, Python, CUDA) as plain tensors and tuples, so that
``torch.load(path, weights_only=True)`` reads a checkpoint's ``trainer_state.pt`` back."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

