"""lintime without Triton, as a CPU build of PyTorch leaves it: every module that does not itself
launch kernels imports, every family trains and decodes on the CPU, the command line trains, evaluates,
generates and exports, and asking for the Triton backend says so in one line.

The test environment has Triton (the interpreter runs the kernels in CI), so each check runs in a fresh
interpreter with ``import triton`` blocked the way a missing package fails (``ModuleNotFoundError``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

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


def test_the_block_works():
    """The blocker makes ``import triton`` fail as a missing package does (else every test below is void)."""
    res = _run("try:\n    import triton\nexcept ModuleNotFoundError as e:\n    print('blocked', e.name)\n")
    assert res.stdout.strip() == "blocked triton"


def test_every_module_without_kernels_imports():
    """Each module that does not launch kernels imports without Triton (transformers-only modules aside
    when transformers is missing)."""
    mods = _modules_without_kernels()
    assert "lintime.ops.mixed_chunk" in mods and "lintime.cli.train" in mods
    script = r'''
import importlib, sys
bad = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] != "transformers":
            bad.append(f"{name}: {e}")
assert "triton" not in sys.modules
print("\n".join(bad))
'''
    res = _run(script, *mods)
    assert res.stdout.strip() == "", res.stdout


def test_every_family_trains_and_decodes_on_the_cpu():
    """A tiny model of each family: packed forward + backward, then prefill + one decoding step."""
    script = r'''
import torch
sys.path.insert(0, sys.argv[1])
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
print("ok", len(FAMILY_TINY_PRESETS))
'''
    res = _run(script, str(REPO / "tests"))
    assert res.stdout.startswith("ok ")
    assert int(res.stdout.split()[1]) >= 5


def test_asking_for_the_triton_backend_says_triton_is_missing():
    """``backend='triton'`` without Triton: one ValueError naming what to install, for the dispatched ops
    and for the fused decoding steps."""
    script = r'''
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
print("\n".join(msgs))
'''
    lines = _run(script).stdout.strip().splitlines()
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert "Triton is not installed" in line and "pip install" in line, line
    assert "not implemented" in lines[2]


def test_the_command_line_works_without_triton(tmp_path):
    """A tiny train, eval and generate, then ``lintime --help``, as a CPU-only user runs them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"m{i:02d}.py").write_text("".join(f"def f{j}(x):\n    return x + {i * j}\n\n" for j in range(4)))
    script = r'''
from lintime.cli import main
corpus, out = sys.argv[1], sys.argv[2]
rc = main(["train", "--preset", "flash-tiny", "--corpus", corpus, "--cache-dir", out + "/cache", "--context-len", "32",
           "--tokens-per-batch", "128", "--steps", "2", "--eval-tokens", "256", "--sample-tokens", "4", "--no-plots",
           "--no-progress", "--out", out, "--name", "run"])
assert rc == 0, rc
assert main(["eval", out + "/run", "--context-lens", "32", "--max-tokens", "256"]) == 0
assert main(["generate", out + "/run", "--prompt", "def ", "--max-new-tokens", "4"]) == 0
assert "triton" not in sys.modules
import contextlib, io
helped = io.StringIO()
with contextlib.redirect_stdout(helped):
    try:
        rc = main(["--help"])
    except SystemExit as e:
        rc = e.code
assert rc in (0, None) and "train" in helped.getvalue(), (rc, helped.getvalue())
print("done")
'''
    res = _run(script, str(corpus), str(tmp_path / "runs"))
    assert res.stdout.strip().endswith("done"), res.stdout[-2000:]


def test_shared_host_modules_do_not_import_triton_at_the_top():
    """The host modules every op imports keep Triton behind the first launch (one interpreter: each module's
    import runs its own top-level imports, so Triton absent after each says it of each)."""
    res = _run("import lintime.ops.utils.launching\nprint('triton' in sys.modules)\n"
               "import lintime.ops.dispatch\nprint('triton' in sys.modules)")
    assert res.stdout.split() == ["False", "False"]
