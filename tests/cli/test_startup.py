"""Starting the command line: help and flag errors answer before torch is imported (importing torch is
most of a command's start-up), and a command imports only what it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

PROBE = r'''
import sys
from lintime.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
heavy = sorted(m for m in ("torch", "numpy", "matplotlib", "tqdm", "transformers", "triton") if m in sys.modules)
print("IMPORTED", ",".join(heavy), file=sys.stderr)
sys.exit(rc)
'''


def _run(*argv: str) -> tuple[int, str, list[str]]:
    res = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=ENV, timeout=120)
    line = next(x for x in res.stderr.splitlines() if x.startswith("IMPORTED"))
    return res.returncode, res.stdout + res.stderr, [m for m in line.split(" ", 1)[1].split(",") if m]


@pytest.mark.parametrize("argv", [("--help",), ("train", "--help"), ("eval", "--help"), ("generate", "--help"),
                                  ("bench", "--help"), ("export", "--help"), ("--version",)])
def test_help_imports_no_torch(argv):
    rc, out, heavy = _run(*argv)
    assert rc == 0, out
    assert "usage" in out or "lintime" in out
    assert heavy == [], heavy


@pytest.mark.parametrize("argv", [("train", "--no-such-flag"), ("eval",), ("train", "--steps", "many")])
def test_flag_errors_answer_before_torch(argv):
    rc, out, heavy = _run(*argv)
    assert rc == 2, out
    assert heavy == [], heavy


def test_every_command_module_loads_without_torch():
    """The parser is built from every command's signature: none of the command modules imports torch (or
    the training stack) at its top."""
    script = r'''
import sys
import lintime.cli as cli
cli.build_parser()
assert len(cli.COMMANDS) >= 8, sorted(cli.COMMANDS)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("lintime.training.trainer")))
'''
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_the_steps_default_in_help_and_docs_is_the_one_the_trainer_uses():
    """`lintime train --help` and docs/cli.md said 200 steps while the trainer ran 300: both now say the trainer's."""
    import re

    from lintime.training.config import TrainConfig

    steps = TrainConfig().resolved().steps
    res = subprocess.run([sys.executable, "-m", "lintime", "train", "--help"], capture_output=True, text=True,
                         env=ENV, timeout=120)
    helped = " ".join(res.stdout.split())
    said = re.search(r"--steps STEPS\s+stop after this many optimiser steps \(default (\d+) when no budget", helped)
    assert said and int(said.group(1)) == steps, helped[:400]
    doc = (REPO / "docs" / "cli.md").read_text()
    row = re.search(r"\| `--steps N` \| optimiser steps \(default (\d+) when no budget", doc)
    assert row and int(row.group(1)) == steps
