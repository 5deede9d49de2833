"""What ``lintime eval`` / ``generate`` load: a run folder, a step folder, or a folder written by
``lintime export`` (HF layout), all as :class:`lintime.training.checkpoint.LoadedModel`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the commands that load a model, not by `lintime --help`
    import torch

    from lintime.training.checkpoint import LoadedModel

HF_WEIGHTS = "model.safetensors"
HF_PREFIX = "lintime."  # LintimeForCausalLM keeps the lintime CausalLM as `self.lintime`


def hf_export_config(path: str | os.PathLike) -> dict | None:
    """``config.json`` of a ``lintime export`` folder, or None when ``path`` is not one."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file() or not (Path(path) / HF_WEIGHTS).is_file():
        return None
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("model_type") == "lintime" and "lintime_model" in data else None


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """A run / step folder (:func:`lintime.training.load_model`) or an exported HF folder (read
    without transformers: the lintime model config, its weights in float32, the tokenizer)."""
    hf = hf_export_config(path)
    if hf is None:
        from lintime.training.checkpoint import load_model

        return load_model(path, device)
    return _load_export(Path(path), hf, device)


def _load_export(path: Path, hf: dict, device) -> LoadedModel:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from lintime.models import CausalLM, ModelConfig
    from lintime.training.checkpoint import LoadedModel, nonfinite_tensors

    try:
        model = CausalLM(ModelConfig.from_dict(hf["lintime_model"]))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}/config.json: the lintime model config cannot be built here ({err})") from None
    try:
        tensors = load_file(str(path / HF_WEIGHTS))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path / HF_WEIGHTS} is unreadable: {err}") from None
    state = {k.removeprefix(HF_PREFIX): v.float() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / HF_WEIGHTS} does not fit its config.json: {len(missing)} missing, "
                         f"{len(unexpected)} unexpected tensors (e.g. {(missing or unexpected)[0]})")
    bad = nonfinite_tensors(model)
    if bad:
        raise ValueError(f"{path / HF_WEIGHTS} is corrupted: {len(bad)} tensor(s) hold NaN or infinity (e.g. {bad[0]})")
    tokenizer = _export_tokenizer(path, model.config.vocab_size)
    config = {"model": hf["lintime_model"], "objective": "clm", "tokenizer": tokenizer.name, "train": {}}
    return LoadedModel(model=model.to(device).eval(), tokenizer=tokenizer, config=config, step=-1)


def _export_tokenizer(path: Path, vocab_size: int):
    """The lintime tokenizer behind the export's ``tokenizer.json``: the byte tokenizer when it is
    the 256-byte vocabulary without merges (:func:`lintime.hf.tokenization.hf_tokenizer`), else the BPE."""
    from lintime.data import BPETokenizer, ByteTokenizer, DataError

    try:
        spec = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"no readable tokenizer.json in {path} ({err})") from None
    model = spec.get("model") or {}
    if len(model.get("vocab") or {}) == 256 and not model.get("merges") and vocab_size == ByteTokenizer().vocab_size:
        return ByteTokenizer()
    try:
        return BPETokenizer.load(path)
    except DataError as err:
        raise FileNotFoundError(f"{path}: {err}") from None
