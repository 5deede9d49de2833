"""``lintime export``: a training checkpoint -> an HF folder.

The folder holds ``config.json`` (:class:`~lintime.hf.configuration.LintimeConfig`, with
``auto_map`` for ``trust_remote_code``), ``generation_config.json``, ``model.safetensors``, the
tokenizer (``tokenizer.json`` + ``tokenizer_config.json``: the byte tokenizer or the trained BPE
as a ``PreTrainedTokenizerFast`` with lintime's ids) and, unless ``remote_code=False``, the
remote-code files of :mod:`lintime.hf.remote_code`.  It loads with
``AutoModelForCausalLM.from_pretrained(DIR)`` (after ``import lintime.hf``) or
``from_pretrained(DIR, trust_remote_code=True)`` (lintime not installed), and works with
``pipeline("text-generation", model=DIR)`` and lm-eval's ``--model hf``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lintime.hf.modeling import LintimeForCausalLM
from lintime.hf.remote_code import write_remote_code
from lintime.hf.tokenization import hf_tokenizer
from lintime.training.checkpoint import load_model
from lintime.utils.io import ordinary_mode

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    remote_code: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write the HF folder of ``checkpoint`` (a run folder or a step folder) into ``out_dir``;
    return it.  ``dtype``: float32 | bfloat16 | float16 (the weights' dtype in the folder)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty (pass --overwrite to write into it)")
    loaded = load_model(checkpoint, device="cpu")
    if loaded.config["objective"] != "clm":
        raise ValueError(f"{checkpoint} is a masked LM: only causal LMs (objective clm) are exported")
    tok = loaded.tokenizer
    mc = loaded.model.config
    hf_tok = hf_tokenizer(tok, model_max_length=mc.max_positions if mc.position == "learned" else None)
    model = LintimeForCausalLM.from_lintime(
        loaded.model.to(_DTYPES[dtype]), bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
    )
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = tok.bos_id, tok.eos_id, tok.pad_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for weights in out.glob("*.safetensors"):  # safetensors writes through a private (0600) temporary file
        ordinary_mode(weights)
    hf_tok.save_pretrained(out)
    if remote_code:
        write_remote_code(out)
    return out
