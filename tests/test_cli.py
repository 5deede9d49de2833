"""The console entry point: version, info, help, and one-line errors with exit status 2."""

import subprocess
import sys

from lintime import __version__
from lintime.cli import main


def test_version_and_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"lintime {__version__}" in out and "op backends on cpu: naive, chunk, recurrent" in out


def test_console_script_runs_as_module():
    r = subprocess.run([sys.executable, "-m", "lintime", "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"lintime {__version__}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: lintime" in capsys.readouterr().out
