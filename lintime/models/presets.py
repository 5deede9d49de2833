"""Named model presets, collected from the registered families.

Names are ``<model>-<size>[-mlm]``:

* ``<model>``: ``transformer`` (Transformer), ``transformer-p`` (Transformer+ = RoPE),
  ``transformer-pp`` (Transformer++ = RoPE + GLU); later families add theirs (``flash``,
  ``flash-quad``, ...);
* ``<size>``: ``tiny`` and ``small`` (byte vocabulary, train on a laptop CPU), ``base`` (the
  seed's ~110M models of Tables 8-9), ``large`` (the ~500M models of Table 10);
* ``-mlm``: the seed's masked-LM configuration of that size (Table 8: ScaleNorm for
  Transformer+ / ++) where it differs from the LM one (Tables 9-10: LayerNorm).

Configs are objective-agnostic: any preset builds a ``CausalLM`` or a ``MaskedLM``.  Each family
contributes its presets through ``register_family(..., presets=...)``, so a new family brings its
own presets without an edit here.  Configs are frozen: share them freely, derive variants with
:func:`get_preset` overrides or ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses

from lintime.models.config import ModelConfig
from lintime.models.registry import available_families, get_family


def all_presets() -> dict[str, ModelConfig]:
    """``{preset name: config}`` over every registered family."""
    out: dict[str, ModelConfig] = {}
    for fam_name in available_families():
        fam = get_family(fam_name)
        if fam.presets is None:
            continue
        for name, cfg in fam.presets().items():
            if name in out:
                raise ValueError(f"preset {name!r} is defined by two families ({out[name].family!r}, {fam_name!r})")
            out[name] = cfg
    return dict(sorted(out.items()))


def preset_names() -> list[str]:
    return list(all_presets())


def get_preset(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with top-level fields replaced (``get_preset('transformer-pp-tiny',
    vocab_size=512)``); the result is validated again."""
    presets = all_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; available: {list(presets)}")
    cfg = presets[name]
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
