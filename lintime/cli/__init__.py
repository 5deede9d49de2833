"""The ``lintime`` command line.

Every subcommand is a plain typed function; its flags are that function's keyword arguments
(STYLE 7).  :func:`build_parser` derives argparse options from the signature and the
``Args:`` section of the docstring, so the help text lives next to the code it documents.
User errors (:class:`CLIError`, ``ValueError`` from validation) print one line and exit 2.
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
    """A user-facing error: printed as one line, exit status 2."""


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
        typ = hints.get(pname, str)
        origin = typing.get_origin(typ)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", ())):
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            typ = args[0] if args else str
        h = helps.get(pname, "")
        if param.default is inspect.Parameter.empty:
            p.add_argument(pname, type=typ, help=h)
        elif typ is bool:
            p.add_argument(f"--{pname.replace('_', '-')}", dest=pname, action=argparse.BooleanOptionalAction,
                           default=param.default, help=h)
        else:
            p.add_argument(f"--{pname.replace('_', '-')}", dest=pname, type=typ, default=param.default,
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not hasattr(ns, "_fn"):
        parser.print_help()
        return 2
    kwargs = {k: v for k, v in vars(ns).items() if k != "_fn"}
    try:
        ns._fn(**kwargs)
    except _user_errors() as e:
        print(f"lintime: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lintime: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
