"""The ``lintime`` command line.

Every subcommand is a plain typed function; its flags are that function's keyword arguments
(so a new setting is one argument).  :func:`build_parser` derives argparse options from the signature and the
``Args:`` section of the docstring, so the help text lives next to the code it documents.
A flag that is not given is not passed (the function's default applies); a function with a
``_given`` parameter also receives the names of the flags that were given (``train --resume``
refuses a given setting that differs from the run's, even one equal to its default).
User errors (:class:`CLIError`, ``ValueError`` from validation) and filesystem faults
(permission, read-only, disk full, a closed pipe) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from typing import Callable

COMMANDS: dict[str, Callable] = {}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status ``exit_code`` (2)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Stopped(CLIError):
    """The command was stopped by a signal after saving its work (exit status 128 + the signal)."""


def command(fn: Callable) -> Callable:
    """Register ``fn`` as subcommand ``fn.__name__`` (underscores become dashes)."""
    COMMANDS[fn.__name__.replace("_", "-")] = fn
    return fn


def _arg_help(doc: str) -> dict[str, str]:
    helps: dict[str, str] = {}
    m = re.search(r"Args:\n(.*?)(\n\s*\n|\Z)", doc or "", re.S)
    if not m:
        return helps
    name = None
    for line in m.group(1).splitlines():
        hit = re.match(r"\s{4,8}(\w+):\s*(.*)", line)
        if hit:
            name = hit.group(1)
            helps[name] = hit.group(2).strip()
        elif name:
            helps[name] += " " + line.strip()
    return helps


def _add_function(sub: argparse._SubParsersAction, name: str, fn: Callable) -> None:
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0]
    p = sub.add_parser(name, help=summary, description=doc.split("Args:")[0].strip())
    helps = _arg_help(doc)
    hints = typing.get_type_hints(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        if pname.startswith("_"):
            continue
        typ = hints.get(pname, str)
        origin = typing.get_origin(typ)
        switch = False  # `bool | str`: a switch that may take a value (--flag, --flag VALUE, --no-flag)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", ())):
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            switch = set(args) == {bool, str}
            typ = args[0] if args else str
        h = helps.get(pname, "")
        if switch:
            flag = pname.replace("_", "-")
            p.add_argument(f"--{flag}", dest=pname, nargs="?", const=True, default=argparse.SUPPRESS,
                           help=f"{h} (default: {param.default})")
            p.add_argument(f"--no-{flag}", dest=pname, action="store_const", const=False, default=argparse.SUPPRESS,
                           help=f"the same as --{flag} off")
        elif param.default is inspect.Parameter.empty:
            p.add_argument(pname, type=typ, help=h)
        elif typ is bool:
            p.add_argument(f"--{pname.replace('_', '-')}", dest=pname, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=f"{h} (default: {'on' if param.default else 'off'})")
        else:
            p.add_argument(f"--{pname.replace('_', '-')}", dest=pname, type=typ, default=argparse.SUPPRESS,
                           help=f"{h} (default: {param.default})")
    p.set_defaults(_fn=fn)


def _load_command_modules() -> None:
    """Import every ``lintime/cli/<name>.py``: each registers its subcommands with @command."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


class _Parser(argparse.ArgumentParser):
    """A bad flag is a user error like any other -- one line, exit 2 -- instead of argparse's
    usage block (tens of lines for a subcommand with many flags)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from lintime import __version__

    _load_command_modules()
    parser = _Parser(prog="lintime", description="Linear-time transformers: train, evaluate, sample, benchmark.")
    parser.add_argument("--version", action="version", version=f"lintime {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for name, fn in COMMANDS.items():
        _add_function(sub, name, fn)
    return parser


@command
def info() -> None:
    """Show versions, devices and which op backends are available here."""
    import platform

    import torch

    from lintime import __version__
    from lintime.ops.dispatch import triton_available

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    print(f"lintime {__version__}  python {platform.python_version()}  torch {torch.__version__}  triton {tv}")
    cuda = torch.cuda.is_available()
    print(f"cuda: {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    dev = torch.device("cuda" if cuda else "cpu")
    backs = ["naive", "chunk", "recurrent"] + (["triton"] if triton_available(dev) else [])
    print(f"op backends on {dev.type}: {', '.join(backs)}")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: one line on stderr, exit status 2, no traceback."""
    from lintime.data import DataError

    return (CLIError, DataError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def describe_os_error(err: OSError) -> str:
    """One line naming the path and the cause of a filesystem fault (a temporary file beside a
    target is named by its folder)."""
    import os

    path = err.filename
    if path is not None:
        path = os.fspath(path)
        name = os.path.basename(path)
        if name.startswith(".") and name.endswith(".tmp"):
            path = os.path.dirname(path) or "."
    cause = err.strerror or str(err)
    return f"{path}: {cause}" if path is not None else cause


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def check_writable(path, flag: str, ok_if=None) -> None:
    """Fail early (``CLIError``, one line) when ``path`` -- a folder the command will write, which
    need not exist yet -- cannot be written: its nearest existing ancestor must be a folder in
    which a file can be created (a real test: read-only mounts, permissions, a full disk).
    Nothing is left behind.  ``ok_if(folder)``: an existing folder that passes it (e.g. a complete
    cache, only read) is not tested."""
    import tempfile
    from pathlib import Path

    target = Path(path).expanduser()
    if ok_if is not None and target.is_dir() and ok_if(target):
        return
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise CLIError(f"cannot write {flag} {target}: {probe} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        raise CLIError(f"cannot write {flag} {target}: {err.strerror or err} ({probe})") from None


def set_threads(threads: int, *, device: str = "auto", n_params: int | None = None) -> None:
    """PyTorch's intra-op CPU threads: ``threads`` when > 0; 0 = auto, one thread for a model
    under 20M parameters (a tiny preset's ops are too small to split: on a busy CPU two threads
    made eval / generate several times slower than one), else PyTorch's default."""
    import torch

    if threads < 0:
        raise CLIError(f"--threads must be >= 0 (0 = auto), got {threads}")
    if threads > 0:
        torch.set_num_threads(threads)
    elif n_params is not None and n_params < 20_000_000 and not str(device).startswith("cuda"):
        torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not hasattr(ns, "_fn"):
        parser.print_help()
        return 2
    kwargs = {k: v for k, v in vars(ns).items() if k != "_fn"}
    if "_given" in inspect.signature(ns._fn).parameters:
        kwargs["_given"] = frozenset(kwargs)
    try:
        ns._fn(**kwargs)
    except BrokenPipeError:  # `lintime ... | head`: the reader left
        silence_stdout()
        print("lintime: error: standard output was closed early (broken pipe)", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"lintime: {e}", file=sys.stderr)
        return e.exit_code
    except _user_errors() as e:
        print(f"lintime: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except OSError as e:
        print(f"lintime: error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lintime: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
