"""Mixer families: a family name -> (sub-config dataclass, mixer builder).

A family is the kind of token mixer a model's blocks use (``softmax`` multi-head attention,
later ``gau``, ``flash``, ``linear``, ``gla``, ``vq``, ...).  :class:`~lintime.models.config.ModelConfig`
names its family and carries that family's sub-config; the backbone asks the family's builder
for one mixer per block.  Nothing in the model code branches on family names.

Adding a family (no edit to the model code): write ``lintime/models/families/<name>.py`` with

* a frozen dataclass sub-config (JSON-able fields, ``__post_init__`` validation, optionally
  ``check(config)`` for checks that involve the model config, e.g. ``d_model % n_heads``);
* a builder ``build(config: ModelConfig, layer_idx: int, causal: bool) -> Mixer``;
* optionally ``presets()`` returning ``{preset name: ModelConfig}`` (see :mod:`lintime.models.presets`);
* ``register_family("<name>", SubConfig, build, seed=..., description=..., presets=presets)``
  at module level.

:func:`get_family` imports ``lintime.models.families.<name>`` on first use, so the file is
found by its name; code outside the package (a user's own mixer) calls :func:`register_family`
itself before building a config that names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from typing import Any, Callable

from torch import nn

# The registry sits below the config: :class:`~lintime.models.config.ModelConfig` looks families
# up here, so the types below name it ``Any`` rather than import it (no import cycle).
MixerBuilder = Callable[[Any, int, bool], nn.Module]  # (ModelConfig, layer index, causal) -> mixer
PresetTable = Callable[[], "dict[str, Any]"]  # () -> {preset name: ModelConfig}


@dataclasses.dataclass(frozen=True)
class Family:
    """A registered mixer family."""

    name: str
    config_cls: type
    build_mixer: MixerBuilder
    seed: str = ""
    description: str = ""
    presets: PresetTable | None = None


_FAMILIES: dict[str, Family] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_family(
    name: str,
    config_cls: type,
    build_mixer: MixerBuilder,
    *,
    seed: str = "",
    description: str = "",
    presets: PresetTable | None = None,
) -> Family:
    """Register (idempotently) the family ``name``; registering a *different* family under a
    taken name raises.  ``presets`` is a function returning the family's named configs (called
    when presets are listed, after registration, so it may build ``ModelConfig``s)."""
    if not _NAME.match(name):
        raise ValueError(f"family name {name!r} must be lower-case letters, digits and '_' (a module name)")
    if not (dataclasses.is_dataclass(config_cls) and isinstance(config_cls, type)):
        raise TypeError(f"family {name!r}: the sub-config must be a dataclass type, got {config_cls!r}")
    if not callable(build_mixer):
        raise TypeError(f"family {name!r}: build_mixer must be callable")
    fam = Family(name, config_cls, build_mixer, seed, description, presets)
    old = _FAMILIES.get(name)
    if old is not None and (old.config_cls is not config_cls or old.build_mixer is not build_mixer):
        raise ValueError(f"family {name!r} is already registered (by {old.config_cls.__module__})")
    _FAMILIES[name] = fam
    return fam


def _discover(name: str) -> None:
    try:
        importlib.import_module(f"lintime.models.families.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"lintime.models.families.{name}":
            raise  # the family module exists but one of its imports is missing


def get_family(name: str) -> Family:
    """The family ``name``, importing ``lintime.models.families.<name>`` on first use."""
    if not isinstance(name, str):
        raise TypeError(f"family must be a string, got {type(name).__name__}")
    if name not in _FAMILIES and _NAME.match(name):
        _discover(name)
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered families: {available_families()}")
    return _FAMILIES[name]


def available_families() -> list[str]:
    """Names of all families: the built-in ones under ``lintime/models/families/`` plus any
    registered from outside."""
    from lintime.models import families as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in _FAMILIES:
            _discover(info.name)
    return sorted(_FAMILIES)
