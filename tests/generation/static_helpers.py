"""Every registered family's tiny presets, with chunk / block / row sizes of 8 so that short test
sequences cross several boundaries (the list comes from the registry: a new family cannot escape
the static-decoding tests)."""

from __future__ import annotations

import dataclasses

import torch

from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset
from lintime.models.presets import all_presets
from lintime.models.registry import available_families

SMALL = 8  # chunk / block / row length of the test models
_SIZE_FIELDS = ("chunk_size", "block_len")


def family_presets() -> list[str]:
    """Every tiny preset, checked to cover every registered family; plus ``flash-tiny+fta``
    (FLASH with first-to-all, whose state holds a KV cache)."""
    tiny = {name: cfg.family for name, cfg in all_presets().items() if name.endswith("-tiny")}
    missing = set(available_families()) - set(tiny.values())
    if missing:
        raise AssertionError(f"families {sorted(missing)} have no -tiny preset: the decoding tests cannot cover them")
    return sorted(tiny) + ["flash-tiny+fta"]


def small_model(preset: str, dtype=torch.float32, seed: int = 0, size: int | None = SMALL, device=None) -> CausalLM:
    """``preset`` (``+fta``: with ``first_to_all``) with the byte vocabulary, chunk / block / row
    sizes of ``size`` (``None``: the preset's own)."""
    name, _, extra = preset.partition("+")
    cfg = get_preset(name, vocab_size=ByteTokenizer.vocab_size)
    changes = {}
    if size is not None:
        changes = {f.name: size for f in dataclasses.fields(cfg.mixer) if f.name in _SIZE_FIELDS}
    if extra == "fta":
        changes["first_to_all"] = True
    if changes:
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, **changes))
    torch.manual_seed(seed)
    return CausalLM(cfg).to(device=device, dtype=dtype).eval()
