"""``lintime bench ops`` case selection (no CUDA needed): groups, ``group.name``, unambiguous short
names (``--cases flash,linear,gla``), and one-line errors for unknown names."""

from __future__ import annotations

import pytest

from lintime.bench import discover, select
from lintime.cli import main


def test_cases_are_discovered_with_their_defaults():
    cases = discover()
    assert {"flash.mixed_chunk", "flash.gau", "flash.graph", "linear_gla.linear", "linear_gla.gla",
            "linear_gla.decode"} <= set(cases)
    assert cases["flash.mixed_chunk"][1] and not cases["flash.graph"][1]


def test_groups_full_names_and_short_names():
    flash = [n for n, _ in select("flash")]
    assert flash and all(n.startswith("flash.") for n in flash) and "flash.graph" not in flash
    assert [n for n, _ in select("flash.graph")] == ["flash.graph"]
    assert [n for n, _ in select("flash,linear,gla")] == flash + ["linear_gla.linear", "linear_gla.gla"]
    assert {n for n, _ in select("all")} == {n for n, (_, default) in discover().items() if default}


def test_unknown_case_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="bench case 'nope': unknown"):
        select("nope")
    assert main(["bench", "ops", "--list-cases"]) == 0
    assert "flash.graph  (not run by default)" in capsys.readouterr().out
