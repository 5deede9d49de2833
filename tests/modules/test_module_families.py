"""Structure of lintime.modules (docs/design/conventions.md §2): every building-block folder is in the export
registry, has its textbook reference and chunked form, dispatches through a table, exports exactly its public
function(s) and declares its Triton launch in ``triton/launch.py``."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import lintime.modules as modules

ROOT = Path(modules.__file__).parent


def _families() -> dict[str, list[str]]:
    """Family folder -> its exported names, from ``lintime.modules``' export registry."""
    out: dict[str, list[str]] = {}
    for name, family in modules._EXPORTS.items():
        out.setdefault(family, []).append(name)
    return out


def _family_dirs():
    return sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_every_family_folder_is_exported():
    """Every sub-package of lintime.modules is in the export registry, and back."""
    assert sorted(_families()) == _family_dirs()


def test_every_family_has_naive_chunk_and_a_dispatch_table():
    for d in _family_dirs():
        assert (ROOT / d / "naive.py").exists(), f"{d!r} has no naive.py"
        assert (ROOT / d / "chunk.py").exists(), f"{d!r} has no chunk.py"
        impls = importlib.import_module(f"lintime.modules.{d}")._IMPLS
        assert {"naive", "chunk", "triton"} <= set(impls), f"{d!r} registers {sorted(impls)}"


def test_no_family_folder_shadows_an_export():
    """A folder named like one of ``lintime.modules``' exports would shadow it once its modules are imported."""
    assert not set(_family_dirs()) & set(modules.__all__)


def test_export_after_importing_its_family_modules_first():
    """In a fresh interpreter: the family modules imported first, the exports are still the functions."""
    code = ("import importlib, inspect; fams = {fams!r}\n"
            "[importlib.import_module('lintime.modules.' + f) for f in fams]\n"
            "import lintime.modules as m\n"
            "bad = [n for n in m.__all__ if inspect.ismodule(getattr(m, n))]\n"
            "assert not bad, bad").format(fams=sorted(_families()))
    subprocess.run([sys.executable, "-c", code], check=True)


def test_families_export_their_public_functions():
    for fam, names in _families().items():
        mod = importlib.import_module(f"lintime.modules.{fam}")
        for name in names:
            assert getattr(mod, name) is getattr(modules, name)
        assert sorted(mod.__all__) == sorted(names)


def test_every_family_declares_its_launch():
    """``triton/launch.py`` holds the family's one launch configuration, a ``<Family>Launch(LaunchConfig)``, and its
    one ``default_launch``; no other module of the family defines either (docs/design/names.md, launch
    configurations)."""
    from lintime.ops.utils.launching import LaunchConfig

    for fam in _family_dirs():
        launch = importlib.import_module(f"lintime.modules.{fam}.triton.launch")
        configs = [v for v in vars(launch).values()
                   if isinstance(v, type) and issubclass(v, LaunchConfig) and v.__module__ == launch.__name__]
        assert len(configs) == 1 and configs[0].__name__.endswith("Launch"), (fam, configs)
        assert configs[0].__name__.lower() == fam.replace("_", "") + "launch", configs[0].__name__
        assert callable(launch.default_launch) and isinstance(configs[0](), LaunchConfig)
        for path in (ROOT / fam).rglob("*.py"):
            if path.name == "launch.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
            bad = {n for n in defined if n == "default_launch" or n.endswith("Launch")}
            assert not bad, f"{path}: {sorted(bad)} belong in triton/launch.py"
