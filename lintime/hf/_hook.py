"""Register lintime's classes with HF transformers' Auto classes, lazily (stdlib only).

``import lintime`` calls :func:`install`, which costs nothing measurable: it neither imports
transformers nor checks for it.  It adds one finder to ``sys.meta_path`` that watches for two
transformers modules, and registers right after each has run:

* ``transformers.models.auto.configuration_auto`` -> ``AutoConfig.register("lintime", LintimeConfig)``;
* ``transformers.models.auto.modeling_auto`` -> ``AutoModelForCausalLM.register(LintimeConfig, LintimeForCausalLM)``.

Those are the modules ``AutoConfig`` / ``AutoModelForCausalLM`` live in, so registration happens
exactly when a program starts using the Auto classes, in whatever order it imports lintime and
transformers (a module that is already imported is handled at once).  Without transformers
installed the finder simply never fires.  A failure while registering is reported as a warning,
never as an error in the user's ``import transformers``.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

_CONFIG_AUTO = "transformers.models.auto.configuration_auto"
_MODELING_AUTO = "transformers.models.auto.modeling_auto"


def _register_config(module) -> None:
    from lintime.hf.configuration import LintimeConfig

    module.AutoConfig.register(LintimeConfig.model_type, LintimeConfig, exist_ok=True)


def _register_model(module) -> None:
    from lintime.hf.configuration import LintimeConfig
    from lintime.hf.modeling import LintimeForCausalLM

    module.AutoModelForCausalLM.register(LintimeConfig, LintimeForCausalLM, exist_ok=True)


_CALLBACKS = {_CONFIG_AUTO: _register_config, _MODELING_AUTO: _register_model}


def _run(name: str, module) -> None:
    try:
        _CALLBACKS[name](module)
    except Exception as err:  # never break the user's import of transformers
        warnings.warn(f"lintime: could not register with transformers ({type(err).__name__}: {err})", stacklevel=3)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the registration callback."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, item):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _CALLBACKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Idempotent: register now for the auto modules already imported, watch for the others."""
    for name in _CALLBACKS:
        if name in sys.modules:
            _run(name, sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
