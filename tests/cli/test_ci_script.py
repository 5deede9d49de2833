"""``.ci/run`` proves the README the way a user meets it: each of the README's two set-up commands runs
verbatim, in a virtual environment made fresh for it, before anything else is installed there."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _setup_commands() -> list[str]:
    """The shell lines of the README's "Set-up commands" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Set-up commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_readme_has_exactly_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("lintime train") and "pytest" in cmds[1]
    assert all(c.startswith("pip install torch==2.13.0 && pip install -e ") for c in cmds)


def test_ci_runs_each_setup_command_verbatim_in_a_fresh_environment():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for cmd in _setup_commands():
        assert cmd in ci, f"not verbatim in .ci/run: {cmd}"
        at = ci.index(cmd)
        before = [line.strip() for line in ci[:at] if line.strip() and not line.strip().startswith(("#", "echo"))]
        # the command follows a fresh environment, with nothing installed in between
        assert before[-1].startswith("fresh_venv") or (before[-2].startswith("fresh_venv") and "pip" not in before[-1]), before[-2:]
    body = "\n".join(ci)
    assert "python3 -m venv" in body and "activate" in body


def test_ci_checks_the_train_environment_has_no_triton():
    body = (REPO / ".ci" / "run").read_text()
    train_at = body.index(_setup_commands()[0])
    test_at = body.index(_setup_commands()[1])
    assert "import triton" in body[train_at:test_at]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ci_script_parses():
    res = subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
