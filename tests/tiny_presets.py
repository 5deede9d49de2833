"""Tiny models of every mixer family, for the tests that must cover each family (decoding,
HF, export).  The list comes from the registry, so a new family cannot escape those checks: it
needs a ``*-tiny`` preset (or this module fails on import, naming it).

Importable from every test module as ``tiny_presets`` (pytest puts ``tests/`` on ``sys.path``
for the root conftest)."""

from __future__ import annotations

import dataclasses

from lintime.models import ModelConfig, available_families
from lintime.models.presets import all_presets

# A family with several tiny presets names the one the cross-family tests use.
_CHOSEN = {"softmax": "transformer-pp-tiny"}  # the seed's strongest baseline (RoPE + GLU)
# Mixer fields set to 8, so that a test of ~25 tokens crosses several chunk / block boundaries.
_SMALL = {"chunk_size": 8, "block_len": 8}


def _family_tiny_presets() -> list[str]:
    presets = all_presets()
    out = []
    for family in available_families():
        tiny = sorted(n for n, c in presets.items() if c.family == family and n.endswith("-tiny"))
        if family in _CHOSEN:
            tiny = [_CHOSEN[family]] if _CHOSEN[family] in tiny else []
        if len(tiny) != 1:
            raise LookupError(f"family {family!r}: need exactly one '-tiny' preset for the cross-family "
                              f"tests (found {tiny}); add one or name it in tests/tiny_presets.py _CHOSEN")
        out.append(tiny[0])
    return out


FAMILY_TINY_PRESETS = _family_tiny_presets()


def _small_changes(config: ModelConfig) -> dict:
    fields = {f.name for f in dataclasses.fields(config.mixer)}
    return {k: v for k, v in _SMALL.items() if k in fields}


def small_chunks(config: ModelConfig) -> ModelConfig:
    """``config`` with its mixer's chunk / block length set to 8 where the mixer has one."""
    changes = _small_changes(config)
    return dataclasses.replace(config, mixer=dataclasses.replace(config.mixer, **changes)) if changes else config


# preset -> its mixer changes (for helpers that take them as keyword arguments)
SMALL_CHUNKS = {name: _small_changes(all_presets()[name]) for name in FAMILY_TINY_PRESETS}


def saved_run(run, model, *, objective: str = "clm"):
    """``run`` (a path) as a run folder holding ``model`` at step 1, byte tokenizer: what ``load_model`` /
    ``lintime generate`` read.  Returns ``run``."""
    from lintime.data import ByteTokenizer
    from lintime.training.checkpoint import save_checkpoint, write_run_config

    write_run_config(run, model_config=model.config, objective=objective, tokenizer=ByteTokenizer(), train={})
    save_checkpoint(run, 1, model, {"step": 1})
    return run


def saved_preset_run(run, preset: str, *, seed: int = 0):
    """:func:`saved_run` of a fresh ``preset`` model with the byte vocabulary, its weights drawn after
    ``torch.manual_seed(seed)``.  Returns ``run``."""
    import torch

    from lintime.data import ByteTokenizer
    from lintime.models import CausalLM, get_preset

    torch.manual_seed(seed)
    return saved_run(run, CausalLM(get_preset(preset, vocab_size=ByteTokenizer().vocab_size)))
