"""lintime without Triton, as a CPU build of PyTorch leaves it: every module that does not itself
launch kernels imports, every family trains and decodes on the CPU, the command line trains, evaluates,
generates and exports, and asking for the Triton backend says so in one line.

The test environment has Triton (the interpreter runs the kernels in CI), so the checks run in a fresh
interpreter with ``import triton`` blocked the way a missing package fails (``ModuleNotFoundError``).  One
interpreter runs them all, in turn (``without_triton``: an interpreter's start and lintime's import cost seconds on
the 2-core CI machine): first the checks that need nothing imported before them (the block, the host modules' top
level), the module-by-module import last; each check's outcome -- its result or its traceback -- and whether Triton
was in ``sys.modules`` after it come back as JSON, and the tests below read their own.  A check that fails does not
stop the ones after it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "lintime"
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
ENV.pop("TRITON_INTERPRET", None)

BLOCK_TRITON = r'''
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTriton())
for _m in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[_m]
'''


def _run(script: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", BLOCK_TRITON + script, *args], capture_output=True, text=True,
                         env=ENV, cwd=cwd, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _launches_kernels(path: Path) -> bool:
    """A module that imports Triton at its top level: the kernels and their launch code, loaded only on a
    Triton path."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "triton" or n.startswith("triton.") for n in names):
            return True
    return False


def _modules_without_kernels() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if "triton" in parts or parts[-1] == "__main__" or _launches_kernels(path):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


# The checks, in the order they run; each a function returning what its test asserts on (JSON-able).
CHECKS = r"""
import contextlib, io, json, traceback

def check_block():
    try:
        import triton
    except ModuleNotFoundError as e:
        return f"blocked {e.name}"
    return "imported"

def check_host_modules():
    # the first lintime imports of this interpreter: each module's own top-level imports
    seen = []
    import lintime.ops.utils.launching
    seen.append("triton" in sys.modules)
    import lintime.ops.dispatch
    seen.append("triton" in sys.modules)
    return seen

def check_triton_backend():
    import torch
    from lintime.ops import gated_linear_attention, mixed_chunk_attention, softmax_attention
    q = torch.randn(1, 8, 1, 16)
    msgs = []
    for call in (lambda: gated_linear_attention(q, q, q, -torch.rand(1, 8, 1, 16), backend="triton"),
                 lambda: mixed_chunk_attention(q, q, q, q, q, chunk_size=4, backend="triton")):
        try:
            call()
        except ValueError as e:
            msgs.append(str(e))
    try:
        softmax_attention(q, q, q, backend="triton")  # a family with no Triton form keeps its own message
    except ValueError as e:
        msgs.append(str(e))
    return msgs

def check_families():
    import torch
    sys.path.insert(0, TESTS)
    from tiny_presets import FAMILY_TINY_PRESETS, small_chunks
    from lintime.models import CausalLM, get_preset
    for name in FAMILY_TINY_PRESETS:
        torch.manual_seed(0)
        model = CausalLM(small_chunks(get_preset(name)))
        ids = torch.randint(0, model.config.vocab_size, (1, 21))
        cu = torch.tensor([0, 9, 21], dtype=torch.int32)
        logits = model(ids, cu_seqlens=cu)
        logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), name
        with torch.no_grad():  # prefill + one decoding step = the full sequence's logits
            full = model(ids[:, :6])
            _, state = model(ids[:, :5], return_state=True)
            step, state = model(ids[:, 5:6], state=state, return_state=True)
        torch.testing.assert_close(step[:, -1], full[:, 5], rtol=1e-4, atol=1e-4, msg=name)
    return len(FAMILY_TINY_PRESETS)

def check_command_line():
    from lintime.cli import main
    corpus, out = CORPUS, RUNS
    rc = main(["train", "--preset", "flash-tiny", "--corpus", corpus, "--cache-dir", out + "/cache", "--context-len",
               "32", "--tokens-per-batch", "128", "--steps", "2", "--eval-tokens", "256", "--sample-tokens", "4",
               "--no-plots", "--no-progress", "--out", out, "--name", "run"])
    assert rc == 0, rc
    assert main(["eval", out + "/run", "--context-lens", "32", "--max-tokens", "256"]) == 0
    assert main(["generate", out + "/run", "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    helped = io.StringIO()
    with contextlib.redirect_stdout(helped):
        try:
            rc = main(["--help"])
        except SystemExit as e:
            rc = e.code
    assert rc in (0, None) and "train" in helped.getvalue(), (rc, helped.getvalue())
    return "done"

def check_every_module():
    import importlib
    bad = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name.split(".")[0] != "transformers":
                bad.append(f"{name}: {e}")
    return bad

TESTS, CORPUS, RUNS, MODULES = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
report = {}
for check in (check_block, check_host_modules, check_triton_backend, check_families, check_command_line,
              check_every_module):
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the CLI's own output stays out of the report's line
            report[check.__name__] = {"ok": True, "value": check()}
    except BaseException:  # noqa: BLE001 -- each check's failure is its own test's
        report[check.__name__] = {"ok": False, "error": traceback.format_exc()}
    report[check.__name__]["triton_imported"] = "triton" in sys.modules
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def without_triton(tmp_path_factory) -> dict:
    """Every check of :data:`CHECKS` in one fresh interpreter without Triton: ``{check: {"ok", "value" | "error",
    "triton_imported"}}``."""
    mods = _modules_without_kernels()
    assert "lintime.ops.mixed_chunk" in mods and "lintime.cli.train" in mods
    tmp = tmp_path_factory.mktemp("without_triton")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"m{i:02d}.py").write_text("".join(f"def f{j}(x):\n    return x + {i * j}\n\n" for j in range(4)))
    res = _run(CHECKS, str(REPO / "tests"), str(corpus), str(tmp / "runs"), *mods)
    line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def _value(report: dict, check: str):
    """The check's result, after asserting that it ran through and left Triton unimported."""
    got = report[check]
    assert got["ok"], got["error"]
    assert not got["triton_imported"], f"{check}: triton in sys.modules"
    return got["value"]


def test_the_block_works(without_triton):
    """The blocker makes ``import triton`` fail as a missing package does (else every test below is void)."""
    assert without_triton["check_block"]["value"] == "blocked triton"


def test_shared_host_modules_do_not_import_triton_at_the_top(without_triton):
    """The host modules every op imports keep Triton behind the first launch (the interpreter's first lintime
    imports: each module's import runs its own top-level imports, so Triton absent after each says it of each)."""
    assert _value(without_triton, "check_host_modules") == [False, False]


def test_asking_for_the_triton_backend_says_triton_is_missing(without_triton):
    """``backend='triton'`` without Triton: one ValueError naming what to install, for the dispatched ops
    and for the fused decoding steps."""
    lines = _value(without_triton, "check_triton_backend")
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert "Triton is not installed" in line and "pip install" in line, line
    assert "not implemented" in lines[2]


def test_every_family_trains_and_decodes_on_the_cpu(without_triton):
    """A tiny model of each family: packed forward + backward, then prefill + one decoding step."""
    assert _value(without_triton, "check_families") >= 5


def test_the_command_line_works_without_triton(without_triton):
    """A tiny train, eval and generate, then ``lintime --help``, as a CPU-only user runs them."""
    assert _value(without_triton, "check_command_line") == "done"


def test_every_module_without_kernels_imports(without_triton):
    """Each module that does not launch kernels imports without Triton (transformers-only modules aside
    when transformers is missing); Triton is still not imported after them all."""
    bad = _value(without_triton, "check_every_module")
    assert bad == [], "\n".join(bad)
