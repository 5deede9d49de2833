"""The package's import structure: no import cycles between lintime's modules, the layering of
docs/design/conventions.md §1 (``ops`` / ``modules`` -> ``layers`` -> ``models`` -> ``training`` / ``generation`` /
... -> ``cli``; nothing lower imports anything higher; inside the kernel layer, ``lintime/ops/*.py`` ->
``modules`` -> the attention families of ``ops``), and ``import lintime`` without side effects (no transformers,
no subpackage).

The graphs are read from the source with ``ast`` (every ``import`` statement, at module level or
inside a function: a function-local import is still a dependency, and a cycle through one is
still a cycle), so the checks need no import of the modules themselves."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lintime"

# Subpackage -> the lintime subpackages it may import (its own is always allowed; so is the root
# ``lintime`` for ``__version__``, which test_root_package_imports_nothing keeps free of imports).
_KERNELS = {"ops", "modules"}  # one layer, torch and triton only (docs/design/conventions.md §1)
_BELOW_TRAINING = {"generation", "evaluation", "models", "layers", "data", "utils"} | _KERNELS
ALLOWED = {
    "utils": set(),
    # inside the kernel layer: lintime/ops/*.py -> modules -> ops' attention families (test_kernel_layer_order)
    "ops": {"modules"},
    "modules": {"ops"},
    "data": {"utils"},
    "layers": {"utils"} | _KERNELS,
    "models": {"layers", "utils"} | _KERNELS,
    "generation": {"models", "layers", "data", "utils"} | _KERNELS,
    "evaluation": {"generation", "models", "layers", "data", "utils"} | _KERNELS,
    "training": _BELOW_TRAINING,
    "hf": _BELOW_TRAINING | {"training"},
    "bench": _BELOW_TRAINING | {"training"},
    "serving": _BELOW_TRAINING | {"training"},
    "cli": _BELOW_TRAINING | {"training", "hf", "bench", "serving"},
    "__main__": {"cli"},
}
THIRD_PARTY_OF_KERNELS = {"torch", "triton"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


@functools.cache  # every test below reads the same sources: parsed once
def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import statement of the module, relative ones
    resolved; ``from pkg import sub`` names ``pkg.sub`` when that is a module (a shared list: not to be changed)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full if full in MODULES else base, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> lintime modules whose code runs when it imports them: the module itself and
    every package above it that the importer is not inside (a package's ``__init__`` runs first)."""
    graph = {}
    for name, path in MODULES.items():
        deps = set()
        for target, _ in _imports(name, path):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in MODULES and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for dep in sorted(graph[node]):
            if colour[dep] == GREY:
                return stack[stack.index(dep):] + [dep]
            if colour[dep] == WHITE and (cycle := visit(dep)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    graph = _graph()
    assert "lintime.models.backbone" in graph["lintime.models"]  # the graph sees the package
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_layering():
    """Each subpackage imports only the subpackages below it (``ALLOWED``)."""
    assert set(ALLOWED) >= {_subpackage(m) for m in MODULES} - {None}, "a new subpackage needs its row in ALLOWED"
    bad = []
    for name, path in MODULES.items():
        sub = _subpackage(name)
        if sub is None:
            continue
        for target, line in _imports(name, path):
            if target != "lintime" and not target.startswith("lintime."):
                continue
            other = _subpackage(target)
            if other is not None and other != sub and other not in ALLOWED[sub]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({sub}) imports {target}")
    assert not bad, "imports against the layering (docs/design/conventions.md §1):\n" + "\n".join(bad)


def test_kernels_import_only_torch_and_triton():
    """``ops`` and ``modules``: the standard library, torch, triton and each other, nothing else."""
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name, path in MODULES.items():
        if _subpackage(name) not in _KERNELS:
            continue
        for target, line in _imports(name, path):
            top = target.split(".")[0]
            if top and top not in stdlib and top != "lintime" and top not in THIRD_PARTY_OF_KERNELS:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def _kernel_rank(name: str) -> int | None:
    """The order inside the kernel layer: 0 the shared machinery (``lintime.ops.utils`` and its modules: launching,
    segments, state passing, TMA, the relative bias; or a module directly in ``lintime/ops/``: dispatch, fold), 1 a
    building block (``lintime.modules.<family>...``), 2 an attention
    family (``lintime.ops.<family>...``); ``None`` outside the layer (and for the two package roots, whose
    lazy exports import nothing at import time)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] not in _KERNELS:
        return None
    if parts[1] == "modules":
        return 1
    if parts[2] == "utils":
        return 0
    return 0 if MODULES.get(".".join(parts[:3])) == ROOT / "ops" / f"{parts[2]}.py" else 2


def test_kernel_layer_order():
    """A building block imports only the shared machinery of ``ops``, never an attention family, and the
    shared machinery imports no building block; an attention family may use a building block (FLASH's decoding
    step runs the heads op's chunked form)."""
    assert _kernel_rank("lintime.ops.utils.launching") == 0 and _kernel_rank("lintime.ops.dispatch") == 0
    assert _kernel_rank("lintime.modules.norm.triton.ops") == 1 and _kernel_rank("lintime.ops.gla.chunk") == 2
    bad = []
    for name, path in MODULES.items():
        rank = _kernel_rank(name)
        if rank is None:
            continue
        for target, line in _imports(name, path):
            other = _kernel_rank(target)
            if target in ("lintime.ops", "lintime.modules"):
                other = 2 if target == "lintime.ops" else 1  # a public export: the families behind it
            if other is not None and other > rank:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    assert not bad, "imports against the kernel layer's order (docs/design/conventions.md §1):\n" + "\n".join(bad)


def test_root_package_imports_nothing():
    assert _imports("lintime", MODULES["lintime"]) == []


def test_families_stand_alone():
    """No family module imports another (loading ``vq`` must not register ``gau``): what they share is
    lintime/models/shared.py."""
    families = {n for n in MODULES if n.startswith("lintime.models.families.")}
    bad = [(name, dep, line) for name in sorted(families) for dep, line in _imports(name, MODULES[name])
           if dep in families and dep != name]
    assert not bad, bad


def test_no_package_attribute_shadows_its_module():
    """``import lintime.generation.generate`` once gave the function that the package re-exported under the
    module's name; no package exports a name that is also one of its submodules."""
    code = r'''
import importlib, pkgutil, types
import lintime
bad = []
def walk(pkg):  # every package below lintime, as pkgutil.walk_packages, without importing lintime.hf and the
    # Triton packages (not checked; the walk would take in transformers and triton for nothing)
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        if not info.ispkg or ".triton" in info.name or info.name in ("lintime.hf",):
            continue
        try:
            sub_pkg = importlib.import_module(info.name)
        except ImportError:
            continue
        for sub in pkgutil.iter_modules(sub_pkg.__path__):
            value = getattr(sub_pkg, sub.name, None)
            if value is not None and not isinstance(value, types.ModuleType):
                bad.append(f"{info.name}.{sub.name}")
        walk(sub_pkg)
walk(lintime)
print(bad)
'''
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout


# Modules that `lintime generate` must not import: another command's stack (serving, HF, benchmarks, evaluation,
# the training loop), plotting and logging libraries, and the compiler (only --compile needs it).
GENERATE_MUST_NOT_IMPORT = (
    "transformers", "matplotlib", "tensorboard", "fastapi", "uvicorn", "torch._dynamo", "torch._inductor",
    "lintime.serving", "lintime.hf", "lintime.bench", "lintime.evaluation", "lintime.training.trainer",
    "lintime.training.run_setup", "lintime.training.step",
)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    """One fresh interpreter for two checks, in this order: ``import lintime`` alone (what it imports and installs),
    then ``lintime generate`` on a tiny run folder (its lazy imports included) and the modules above it that it took
    in, then ``import lintime.models, lintime.training, lintime.generation, lintime.cli``.  Returns what each step
    saw."""
    run = tmp_path_factory.mktemp("imports") / "run"
    code = f"""
import json, sys
seen = {{}}
import lintime
seen["root"] = {{"subpackages": sorted(m for m in sys.modules if m.startswith("lintime.")),
                "transformers": "transformers" in sys.modules,
                "hooks": [repr(f) for f in sys.meta_path if type(f).__module__.startswith("lintime")]}}
import torch
from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset
from lintime.training.checkpoint import save_checkpoint, write_run_config

tok = ByteTokenizer()
model = CausalLM(get_preset("flash-tiny", vocab_size=tok.vocab_size))
run = {str(run)!r}
write_run_config(run, model_config=model.config, objective="clm", tokenizer=tok, train={{}})
save_checkpoint(run, 1, model, {{"step": 1}})
del model
forbidden = {GENERATE_MUST_NOT_IMPORT!r}
seen["setup_imported"] = sorted(m for m in sys.modules if m.startswith(forbidden))
from lintime.cli import main
seen["generate_rc"] = main(["generate", run, "--prompt", "ab", "--max-new-tokens", "3", "--no-stats"])
seen["generate_imported"] = sorted(m for m in sys.modules if m.startswith(forbidden))
import lintime.models, lintime.training, lintime.generation, lintime.cli
seen["packages_transformers"] = "transformers" in sys.modules
print()
print("SEEN", json.dumps(seen))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(next(x for x in res.stdout.splitlines() if x.startswith("SEEN "))[len("SEEN "):])


def test_import_lintime_has_no_side_effects(fresh):
    """A fresh interpreter: ``import lintime`` imports no subpackage and no transformers, and
    installs no import hook; the model, training, generation and CLI packages load no transformers either
    (HF registration happens on ``import lintime.hf`` only)."""
    root = fresh["root"]
    assert root["subpackages"] == [], "import lintime imported a subpackage"
    assert not root["transformers"], "import lintime imported transformers"
    assert root["hooks"] == [], "import hook installed"
    assert not fresh["packages_transformers"], "a lintime package imported transformers"


def test_generate_imports_only_what_it_needs(fresh):
    """A fresh interpreter runs ``lintime generate`` on a tiny run folder (its lazy imports included), then
    lists the modules above it took in."""
    assert fresh["setup_imported"] == [], "the test's set-up imported them"
    assert fresh["generate_rc"] == 0
    assert fresh["generate_imported"] == [], fresh["generate_imported"]
