"""Issue 43 item 2: benchmarks/quality/mqar.py -- the plan (one model per family x width x rate, on
Zoology's mixture), the rate ladder, the report's table and anchor verdict on records typed in here,
--list's estimates, and one smoke run end to end (two tiny cells on the CPU).

Expected values are worked out by hand from the typed-in records, not copied from the code's output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

torch = pytest.importorskip("torch")

import mqar as bench  # noqa: E402
from lintime.evaluation.tasks.mqar import ZOOLOGY_MIX  # noqa: E402


def test_the_plan_is_zoologys_mixture_protocol():
    cells = bench.plan()
    assert len(cells) == len(bench.FAMILIES) * len(bench.WIDTHS) * len(bench.LRS) == 80
    assert len({c.id for c in cells}) == 80
    assert [c.rung for c in cells] == sorted(c.rung for c in cells)  # rung by rung
    for rung in range(4):
        first = [c for c in cells if c.rung == rung][: len(bench.WIDTHS)]
        assert {c.family for c in first} == {bench.ANCHOR}  # the anchor first in every rung
    assert bench.MIX == ZOOLOGY_MIX
    assert bench.TEST_POINTS == ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64), (512, 128), (1024, 256))
    cfg = bench.task_config(cells[0], device="cpu", max_steps=None, max_seconds=None, smoke=False)
    assert (cfg.mix, cfg.vocab_size, cfg.rows, cfg.point_rows, cfg.epochs, cfg.n_heads) == (
        ZOOLOGY_MIX, 8192, 252, (140, 28, 28, 28, 28), 64, 1)


def _rec(cell, tests, train_points=("64/4", "256/64"), steps=100, train_s=2.0):
    ok = {k: v is not None and v >= 0.99 for k, v in tests.items()}
    return {"id": cell.id, "cell": {"family": cell.family, "width": cell.width, "lr": cell.lr, "rung": cell.rung},
            "status": "done", "tests": tests, "train_points": list(train_points), "converged_points": ok,
            "converged": all(ok[k] for k in train_points), "lowest_train_accuracy": min(tests[k] for k in train_points),
            "stopped": "early stop", "steps": steps, "epochs": 1, "train_s": train_s,
            "state_elements": {"256": 1000 * cell.width, "1024": 4000 * cell.width}}


def test_the_ladder_and_the_report_on_typed_in_records(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "TRAIN_POINTS", ((64, 4), (256, 64)))
    monkeypatch.setattr(bench, "TEST_POINTS", ((64, 4), (256, 64), (1024, 256)))
    monkeypatch.setattr(bench, "MIX", ((64, 4, 100), (256, 64, 100)))
    cells = [c for c in bench.plan() if c.width in (64, 128)]
    get = {c.id: c for c in cells}
    write = lambda c, **kw: (tmp_path / f"{c.id}.json").write_text(json.dumps(_rec(c, **kw)))  # noqa: E731
    # softmax d64: converged at its first rate -> its other rates are not needed
    write(get["softmax-d64-lr0.0022"], tests={"64/4": 1.0, "256/64": 0.995, "1024/256": 0.5})
    # softmax d128: rate 1 not converged (lowest 0.9), rate 2 better on its lowest training point (0.95)
    write(get["softmax-d128-lr0.0022"], tests={"64/4": 0.99, "256/64": 0.9, "1024/256": 0.8})
    write(get["softmax-d128-lr0.01"], tests={"64/4": 0.96, "256/64": 0.95, "1024/256": 0.1})
    write(get["gla-d64-lr0.0022"], tests={"64/4": 0.999, "256/64": 0.4, "1024/256": 0.01})
    assert not bench.needed(get["softmax-d64-lr0.01"], tmp_path, cells)
    assert bench.needed(get["softmax-d128-lr0.00046"], tmp_path, cells)
    assert bench.needed(get["gla-d64-lr0.01"], tmp_path, cells)
    best = bench.cell_best(cells, tmp_path)
    assert best[("softmax", 128)]["cell"]["lr"] == 0.01  # 0.95 > 0.9 on the lowest training point
    text = bench.report(cells, tmp_path, None)
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
            for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows[("softmax", "64")][2:6] == ["0.0022", "1.000*", "0.995*", "0.500"]
    assert rows[("softmax", "128")][2:6] == ["0.01", "0.960", "0.950", "0.100"]
    assert rows[("gla", "64")][3:6] == ["0.999*", "0.400", "0.010"] and rows[("gla", "64")][6] == "64,000"
    assert rows[("gla", "128")][2] == "not run"
    assert "has not converged (at any width) at 1024/256:" in text  # 64/4, 256/64 passed at d64
    listing = bench.listing(cells, tmp_path, max_steps=None, cell_seconds=300.0, smoke=False)
    line = next(ln for ln in listing.splitlines() if ln.startswith("gla-d64-lr0.01 "))
    assert "(measured)" in line and "20.0 ms" in line  # 2 s / 100 steps of the d64 records
    assert "skipped (a lower rung converged)" in next(ln for ln in listing.splitlines()
                                                     if ln.startswith("softmax-d64-lr0.01 "))


def test_smoke_trains_and_tests_every_point(tmp_path, capsys, monkeypatch):
    """``--smoke`` end to end: both cells trained, tested at every point, recorded and listed.  What is checked does
    not depend on how long the cells train (no accuracy is asserted), so the run is cut from the smoke's 64 steps per
    cell to 16 (two of its evaluations every 8 steps; the steps taken still equal ``SMOKE_STEPS``): a quarter of
    the training time."""
    monkeypatch.setattr(bench, "SMOKE_STEPS", 16)
    runs, work = tmp_path / "runs", tmp_path / "work"
    assert bench.main(["--smoke", "--device", "cpu", "--runs-dir", str(runs), "--work-dir", str(work)]) == 0
    recs = {p.stem: json.loads(p.read_text()) for p in runs.glob("*.json")}
    assert set(recs) == {"softmax-d64-lr0.003", "gla-d64-lr0.003"}
    for rec in recs.values():
        assert rec["status"] == "done", rec.get("error")
        assert set(rec["tests"]) == set(rec["converged_points"]) == {"16/2", "32/4", "64/8"}
        assert set(rec["train_accuracy"]) == set(rec["train_points"]) == {"16/2", "32/4"}
        assert rec["config"]["mix"] == [[16, 2, 512], [32, 4, 512]] and rec["steps"] == bench.SMOKE_STEPS
    # softmax's state grows with the prompt (its key/value cache), GLA's does not
    sm, gla = recs["softmax-d64-lr0.003"]["state_elements"], recs["gla-d64-lr0.003"]["state_elements"]
    assert sm["16"] < sm["32"] < sm["64"] and gla["16"] == gla["32"] == gla["64"]
    assert bench.main(["--smoke", "--list", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "softmax-d64-lr0.003" in out and "done" in out and "(measured)" in out
