"""``lintime bench``: speed of ops against context length, with the anchors of other libraries
measured in the same run.

A *case* is a function ``case_<name>(results, quick=False, **kwargs)`` that appends
:class:`Result` rows to ``results``.  Cases live in ``lintime/bench/cases_<group>.py`` modules;
every ``case_*`` function of every such module is discovered (no registry to edit): a new module
``cases_flash.py`` adds its cases to ``lintime bench ops`` by existing.  A module may set
``DEFAULT_CASES`` (names without ``case_``) to choose which of its cases run when none are
named; otherwise all of them do.

Cases are addressed on the command line as ``<group>.<name>`` (e.g. ``linear_gla.linear``), by
``<group>`` (all of that module's default cases), or by ``<name>`` alone where only one group has it
(``--cases flash,linear,gla``).

Only public APIs are timed here (``lintime.ops`` functions, layers, models) against other libraries;
kernel tuning tools live outside the package (the repository's ``lab`` folder).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Result:
    """One timed configuration.  Times are medians in milliseconds (``None`` = not measured);
    ``flops_*`` and ``bytes_*`` are the work and the fewest bytes the op must move (each input
    read once, each output written once), from which the runner derives achieved rates."""

    case: str
    impl: str
    T: int
    B: int
    shape: dict
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    peak_mib: float | None = None
    flops_fwdbwd: float | None = None
    extra: dict = field(default_factory=dict)
    flops_fwd: float | None = None
    bytes_fwd: float | None = None
    bytes_fwdbwd: float | None = None


def case_modules() -> dict[str, object]:
    """``{group: module}`` for every ``lintime/bench/cases_<group>.py``."""
    import lintime.bench as pkg

    mods = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("cases_"):
            mods[info.name[len("cases_"):]] = importlib.import_module(f"lintime.bench.{info.name}")
    return mods


def discover() -> dict[str, tuple[Callable, bool]]:
    """``{"group.name": (function, runs_by_default)}`` of every case."""
    found = {}
    for group, mod in sorted(case_modules().items()):
        default = getattr(mod, "DEFAULT_CASES", None)
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if name.startswith("case_") and fn.__module__ == mod.__name__:
                short = name[len("case_"):]
                found[f"{group}.{short}"] = (fn, default is None or short in default)
    return found


def select(spec: str) -> list[tuple[str, Callable]]:
    """Cases named by ``spec`` (comma-separated ``group.name``, ``group`` or an unambiguous ``name``;
    empty or ``all`` = the default cases of every group)."""
    cases = discover()
    if spec in ("", "all"):
        return [(n, fn) for n, (fn, default) in cases.items() if default]
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in cases:
            chosen.append((item, cases[item][0]))
            continue
        group = [(n, fn) for n, (fn, default) in cases.items() if n.split(".")[0] == item and default]
        named = [(n, fn) for n, (fn, _) in cases.items() if n.split(".", 1)[1] == item]
        if not group and len(named) != 1:
            why = f"in several groups ({', '.join(n for n, _ in named)})" if named else "unknown"
            raise ValueError(f"bench case {item!r}: {why}; known: {', '.join(sorted(cases))}")
        chosen.extend(group or named)
    return chosen


def as_row(r) -> dict:
    """A result (this module's :class:`Result` or any dataclass with the same core fields) as a
    JSON row, with the achieved rates filled in."""
    row = dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r.__dict__)
    for kind in ("fwd", "fwdbwd"):
        ms = row.get(f"{kind}_ms")
        if not ms:
            continue
        if row.get(f"flops_{kind}"):
            row[f"tflops_{kind}"] = row[f"flops_{kind}"] / ms / 1e9
        if row.get(f"bytes_{kind}"):
            row[f"gbps_{kind}"] = row[f"bytes_{kind}"] / ms / 1e6
    return row
