"""``lintime bench``: speed of ops against context length (maps to :func:`lintime.bench.run.run_ops`)."""

from __future__ import annotations

from lintime.cli import command


@command
def bench(what: str, cases: str = "all", out: str = "bench_out", quick: bool = False, list_cases: bool = False) -> None:
    """Benchmark ops against context length, with other libraries' kernels as anchors when installed.

    Prints a table, writes bench_ops.json (and bench_ops.png with matplotlib) to --out.  Needs a
    CUDA device.  Cases are the case_* functions of lintime/bench/cases_<group>.py.

    Args:
        what: ops (the attention operations; the only target for now).
        cases: comma-separated cases (group.name, or a group for all of its default cases; all = every default case).
        out: output folder.
        quick: fewer context lengths (2k, 8k, 32k).
        list_cases: print the known cases and exit.
    """
    if what != "ops":
        raise ValueError(f"unknown bench target {what!r}; choose: ops")
    if list_cases:
        from lintime.bench import discover

        for name, (_, default) in discover().items():
            print(f"{name}{'' if default else '  (not run by default)'}")
        return
    from lintime.bench.run import run_ops

    run_ops(cases, out, quick)
