"""Errors of the data layer.

Every problem a user can fix by changing an argument or installing a package (a missing or
empty corpus, a bad text field, an optional dependency that is not installed, a resume state
that belongs to another dataset) raises :class:`DataError` with a one-line message that says
what is wrong and what to do.  The CLI turns it into that line on stderr and exit status 2.
Programming errors (a negative batch size) stay ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations


class DataError(Exception):
    """A data problem the user can fix; ``str(err)`` is a complete one-line message."""


class EmptySplitError(DataError):
    """A requested split ends up with no documents.  The message names no command-line flag (each
    command accepts other ones); ``lintime data`` adds its ``--val-fraction`` / ``--test-fraction``."""


class MissingDependencyError(DataError, ImportError):
    """An optional dependency (``tokenizers``, ``pyarrow``) is needed but not installed.

    It is both a :class:`DataError` (so the CLI reports it in one line) and an
    ``ImportError`` (so ``except ImportError`` in user code still works).
    """

    def __init__(self, package: str, purpose: str, extra: str | None = None):
        hint = f"pip install {package}" if extra is None else f"pip install 'lintime[{extra}]' (or pip install {package})"
        super().__init__(f"{purpose} needs the optional package '{package}', which is not installed: {hint}")
        self.name = package
        self.package = package


def require(module: str, purpose: str, extra: str | None = None):
    """Import and return the optional ``module``, or raise :class:`MissingDependencyError`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(module, purpose, extra) from err
