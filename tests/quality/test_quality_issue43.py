"""Issue 43's study (benchmarks/quality/run.py, report.py, corpus.py) on synthetic run records.

The curves are typed in here; the expected speed-ups and equal-time values are worked out by hand
from them, so the test checks what report.py computes, not a copy of its output."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

import corpus as qc  # noqa: E402
import report as rep  # noqa: E402
import run as study  # noqa: E402


def _record(run, curve, *, one_off=0.0, gpus=1, val=None, test=None, commit="abcdef0123"):
    """A finished run's record with validation curve ``[(trainer seconds, bits/byte)]``."""
    return {
        "id": run.id, "status": "done", "run": dataclasses.asdict(run), "gpus": gpus, "commit": commit,
        "lr": run.lr or 1e-3, "tokens": run.tokens,
        "val_curve": [{"step": i + 1, "tokens": (i + 1) * 1000, "time_s": t, "bpb": v} for i, (t, v) in enumerate(curve)],
        "timing": {"one_off_s": one_off, "train_s": curve[-1][0]},
        "final": {"validation_bpb": val if val is not None else curve[-1][1],
                  "test_bpb": test if test is not None else curve[-1][1] + 0.01},
    }


def _write(tmp_path, run, rec):
    (tmp_path / f"{run.id}.json").write_text(json.dumps(rec))


def test_the_plan_meets_the_issue():
    runs = study.plan(train_tokens=109_000_000)
    ids = [r.id for r in runs]
    assert len(ids) == len(set(ids))
    study_runs = [r for r in runs if r.kind == "study"]
    assert {r.family for r in study_runs} == {"flash", "transformer-pp", "gla", "vq"}
    for ctx, seeds in ((1024, {0, 1, 2}), (4096, {0}), (8192, {0, 1, 2}), (32768, {0})):
        for fam in study.FAMILIES:
            assert {r.seed for r in study_runs if r.family == fam and r.context == ctx} == seeds
    for r in runs:  # >= 100M tokens and >= 1 epoch, <= 2 epochs, whole steps (the BPE part: test_quality_bpe.py)
        if r.kind != "bpe":
            assert r.tokens >= 100_000_000 and 109_000_000 <= r.tokens <= 2 * 109_000_000
        assert r.tokens % r.tokens_per_batch == 0 and r.tokens_per_batch % r.context == 0
        assert r.est_s <= study.CALL_TRAIN_S  # every run is planned to finish inside one call
    # the sweep is at one context, and comes first
    sweep = [r for r in runs if r.kind == "sweep"]
    assert {r.context for r in sweep} == {study.SWEEP_CONTEXT}
    assert ids[: len(sweep)] == [r.id for r in sweep]
    # a slow family at 32k is planned on several GPUs
    assert next(r for r in runs if r.id == "transformer-pp-32768-s0").gpus > 1
    assert next(r for r in runs if r.id == "flash-1024-s0").gpus == 1
    # a small corpus: 100M tokens (more than 2 epochs of it would be capped)
    assert study.run_tokens(80_000_000) >= 100_000_000
    assert study.run_tokens(40_000_000) <= 80_000_000


def test_study_runs_wait_for_their_family_sweep_and_take_its_best_rate(tmp_path):
    runs = study.plan(smoke=True)
    sweep = [r for r in runs if r.kind == "sweep" and r.family == "flash"]
    lr, why = study.swept_lr("flash", runs, tmp_path)
    assert lr is None and "waits" in why
    for r, v in zip(sweep, (3.0, 2.5)):
        _write(tmp_path, r, _record(r, [(1.0, v + 1), (2.0, v)]))
    # the best (x1) is at the ladder's top edge: the study waits for the next rung, x2
    lr, why = study.swept_lr("flash", runs, tmp_path)
    assert lr is None and "lrx2 not run" in why
    up = next(r for r in study.plan(smoke=True, runs_dir=tmp_path) if r.id == "sweep-flash-128-lrx2")
    _write(tmp_path, up, _record(up, [(1.0, 3.5), (2.0, 2.7)]))
    lr, _ = study.swept_lr("flash", runs, tmp_path)
    assert lr == sweep[1].lr  # the lowest final validation score, now between two worse ones


def test_time_to_reach_and_value_at_interpolate():
    pts = [(10.0, 5.0), (20.0, 3.0), (30.0, 2.0)]
    assert rep.time_to_reach(pts, 4.0) == pytest.approx(15.0)
    assert rep.time_to_reach(pts, 2.5) == pytest.approx(25.0)
    assert rep.time_to_reach(pts, 1.0) is None
    assert rep.value_at(pts, 25.0) == (pytest.approx(2.5), False)
    assert rep.value_at(pts, 40.0) == (2.0, True)  # ended earlier: its last value, marked
    assert rep.value_at(pts, 5.0) == (None, False)


def test_speed_up_equal_time_and_not_run_cells(tmp_path):
    runs = study.plan(smoke=True)
    by = {r.id: r for r in runs}
    ref, flash = by["transformer-pp-128-s0"], by["flash-128-s0"]
    # Transformer++: 100 s of training after a 20 s one-off compile, ends at 3.0 bits/byte
    _write(tmp_path, ref, _record(ref, [(45.0, 4.0), (70.0, 3.5), (120.0, 3.0)], one_off=20.0))
    # FLASH on 2 GPUs (DDP): GPU-seconds = 2 x (t - 10); reaches 3.0 between 40 s (3.2) and 50 s (2.8)
    _write(tmp_path, flash, _record(flash, [(20.0, 4.0), (40.0, 3.2), (50.0, 2.8), (60.0, 2.6)], one_off=10.0, gpus=2))
    tables = rep.study_tables(rep.load(tmp_path, runs), runs)
    row = tables["contexts"][128]
    ref_time = 100.0  # (120 - 20) x 1 GPU
    t_reach = 2 * ((40.0 + 0.5 * 10.0) - 10.0)  # 3.0 halfway between 3.2 and 2.8 -> 45 s trainer time -> 70 GPU-s
    assert row["transformer-pp"]["ref_time"] == pytest.approx(ref_time)
    assert row["flash"]["speedup"] == [pytest.approx(ref_time / t_reach)]
    # at 0.5 x (50 GPU-s = trainer 35 s on FLASH's 2 GPUs): between 20 s (4.0) and 40 s (3.2)
    vals, ended = row["flash"]["equal_time"][0.5]
    assert vals == [pytest.approx(4.0 + (3.2 - 4.0) * (35.0 - 20.0) / 20.0)] and not ended
    vals, ended = row["flash"]["equal_time"][1.0]  # 100 GPU-s > FLASH's 100 GPU-s end? exactly its end
    assert vals == [pytest.approx(2.6)]
    md = rep.markdown(tables, [])
    flash_line = next(line for line in md.splitlines() if line.startswith("| FLASH | ") and "x (1 seed)" in line)
    assert f"{ref_time / t_reach:.2f}x" in flash_line
    assert "on 2 GPUs (DDP)" in md
    # the sweep was not run: its cells say so, and 'chosen' what the study waits for
    sweep_line = next(line for line in md.splitlines() if line.startswith("| FLASH | not run"))
    assert sweep_line == "| FLASH | not run | not run | - (waits: x0.5 not run, x1 not run) |"
    # a context-free plan cell with no record: every column 'not run'
    runs2 = runs + [dataclasses.replace(ref, id="transformer-pp-256-s0", context=256),
                    dataclasses.replace(flash, id="flash-256-s0", context=256)]
    md2 = rep.markdown(rep.study_tables(rep.load(tmp_path, runs2), runs2), [])
    assert "### Context 256" in md2
    assert "| FLASH | 0/1 | not run | not run |" in md2
    assert "not run (no finished Transformer++ run at 256)" in md2


def test_a_family_that_never_reaches_the_reference_is_marked(tmp_path):
    runs = study.plan(smoke=True)
    by = {r.id: r for r in runs}
    ref, flash = by["transformer-pp-128-s0"], by["flash-128-s0"]
    _write(tmp_path, ref, _record(ref, [(10.0, 4.0), (20.0, 3.0)]))
    _write(tmp_path, flash, _record(flash, [(10.0, 4.5), (20.0, 3.5)]))
    tables = rep.study_tables(rep.load(tmp_path, runs), runs)
    assert tables["contexts"][128]["flash"]["speedup"] == []
    assert "not reached (0/1)" in rep.markdown(tables, [])


def test_claims_need_two_seeds_and_a_gap_beyond_the_spreads():
    assert rep.differs([1.0], [2.0]) is None
    assert rep.differs([1.0, 1.2], [2.0, 2.2]) is True
    assert rep.differs([1.0, 2.0], [1.5, 2.5]) is False
    m, s = rep.mean_sd([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0) and math.isclose(rep.mean_sd([4.0])[0], 4.0)


def test_html_to_text_keeps_the_page_and_drops_navigation():
    page = ("<html><head><title>T</title><script>var x = 1;</script></head>"
            "<body class='sidebar-visible'><nav>menu</nav><div class='sidebar'>chapters</div>"
            "<h1>Ownership</h1><p>Rust &amp; memory.</p><pre>fn main() {\n    x();\n}</pre></body></html>")
    text = qc.html_to_text(page)
    assert "Ownership" in text and "Rust & memory." in text and "    x();" in text
    assert "menu" not in text and "chapters" not in text and "var x" not in text


def test_the_split_is_lintimes_path_hash_rule():
    from lintime.data.corpus import split_of as lintime_split  # noqa: PLC0415

    for name in ("linux-doc/Documentation/index.rst", "python-stdlib/json/decoder.py", "perl-doc/perl.pod"):
        assert qc.split_of(name) == lintime_split(name, 0.05, 0.05)
