"""Structure of lintime.ops: every op family folder is in the export registry, has its textbook
reference and exports exactly its public function(s); poisoning really poisons."""

import importlib
from pathlib import Path

import torch

import lintime.ops as ops


def _families() -> dict[str, list[str]]:
    """Family folder -> its exported names, from ``lintime.ops``' export registry."""
    out: dict[str, list[str]] = {}
    for name, family in ops._EXPORTS.items():
        out.setdefault(family, []).append(name)
    return out


SHARED = "utils"  # lintime/ops/utils/: the packing helpers and the Triton paths' shared modules, not a family


def _family_dirs():
    root = Path(ops.__file__).parent
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists() and p.name != SHARED)


def test_every_family_folder_is_exported():
    """Every sub-package of lintime.ops is an op family in the export registry, and back: a new family
    folder cannot escape the checks below."""
    assert sorted(_families()) == _family_dirs()


def test_every_family_has_naive_chunk_and_a_dispatch_table():
    for d in _family_dirs():
        folder = Path(ops.__file__).parent / d
        assert (folder / "naive.py").exists(), f"op family {d!r} has no naive.py"
        assert (folder / "chunk.py").exists(), f"op family {d!r} has no chunk.py"
        impls = importlib.import_module(f"lintime.ops.{d}")._IMPLS
        assert {"naive", "chunk"} <= set(impls), f"op family {d!r} registers {sorted(impls)}"


def test_no_family_folder_shadows_an_export():
    """A family folder named like one of ``lintime.ops``' exports would shadow it: importing the sub-package binds
    its name on ``lintime.ops`` over the lazily exported function (a ``gau_heads`` folder did)."""
    assert not set(_family_dirs()) & set(ops.__all__)


def test_export_after_importing_its_family_modules_first():
    """In a fresh interpreter: the family modules imported first, the exports are still the functions."""
    import subprocess
    import sys

    code = ("import importlib, inspect; fams = {fams!r}\n"
            "[importlib.import_module('lintime.ops.' + f) for f in fams]\n"
            "import lintime.ops as ops\n"
            "bad = [n for n in ops.__all__ if inspect.ismodule(getattr(ops, n))]\n"
            "assert not bad, bad").format(fams=sorted(_families()))
    subprocess.run([sys.executable, "-c", code], check=True)


def test_families_export_their_public_functions():
    for fam, names in _families().items():
        mod = importlib.import_module(f"lintime.ops.{fam}")
        for name in names:
            assert getattr(mod, name) is getattr(ops, name)
        assert sorted(mod.__all__) == sorted(names)


def test_poison_fixture_poisons():
    x = torch.empty(4)
    assert torch.isnan(x).all()
    y = torch.zeros(3).new_empty(5)
    assert torch.isnan(y).all()


def test_ops_import_only_torch_and_triton():
    """Layering (docs/design/conventions.md §1): nothing under lintime.ops imports a higher layer."""
    root = Path(ops.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for higher in ("lintime.layers", "lintime.models", "lintime.training", "lintime.cli", "lintime.data"):
            assert higher not in text, f"{path} imports {higher}"
