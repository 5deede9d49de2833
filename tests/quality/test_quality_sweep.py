"""Issue 43's learning-rate sweep (benchmarks/quality/run.py): the adaptive ladder on records typed in here, in the
format run.py writes, the report's sweep table for them, and the sweep runs' retrieval skipped by the plan (their
time estimate and one smoke sweep run on a CPU).

The ladder's rule, as the tests read it: a family's best sweep run (lowest final validation bits per byte) at the top
(bottom) edge of its ladder calls for the next rung out, twice (half) that edge's factor, until the best is interior
or the next rung would leave x 1/8 .. x 8; a rung that diverged counts as worse than any finished one."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

import report as rep  # noqa: E402
import run as study  # noqa: E402

TRAIN = 112_204_405  # the study corpus's train split (corpus_manifest.json): the plan does not read the manifest
DIVERGED = ("lintime train: error: training diverged at step 57 (the loss is nan) before any checkpoint; try a lower "
            "--lr (the same --name sweep-flash-1024-lrx4 starts the run over)")


def _plan(runs_dir: Path | None = None) -> list:
    return study.plan(train_tokens=TRAIN, runs_dir=runs_dir)


def _rung(runs_dir: Path, family: str, factor: float):
    """The sweep run at ``factor`` as the plan made from the records has it (``None``: not planned)."""
    return next((r for r in _plan(runs_dir) if r.kind == "sweep" and r.family == family and r.lr_factor == factor),
                None)


def _record(run, val: float | None, status: str = "done", **extra) -> dict:
    """A sweep run's record with the fields run.py writes (``val``: its final validation bits per byte)."""
    rec = {"id": run.id, "status": status, "run": dataclasses.asdict(run) | {"steps": run.steps}, "lr": run.lr,
           "lr_source": f"sweep: recipe rate x {run.lr_factor:g}", "commit": "fdb2dac", "gpus": 1,
           "slices": [{"started_utc": "2026-12-02 16:20:00", "wall_s": 250.0, "resumed": False,
                       "rc": 0 if status == "done" else 1, "step_end": run.steps, "device": "cuda", "gpus": 1}],
           "val_curve": [{"step": run.steps, "tokens": run.tokens, "time_s": 200.0, "bpb": val}],
           "timing": {"one_off_s": 6.0, "train_s": 210.0, "tokens_per_s": 5.3e5}, "tokens": run.tokens}
    if status == "done":
        rec["final"] = {"validation_bpb": val, "test_bpb": val - 0.2 if val is not None else val}
    rec.update(extra)
    return rec


def _write(runs_dir: Path, run, rec: dict) -> None:
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / f"{run.id}.json").write_text(json.dumps(rec))  # NaN is written as NaN, as json.dumps does in run.py


def _first_rungs(runs_dir: Path, family: str, scores: dict[float, float]) -> dict[float, object]:
    runs = {r.lr_factor: r for r in _plan() if r.kind == "sweep" and r.family == family}
    for f, v in scores.items():
        _write(runs_dir, runs[f], _record(runs[f], v))
    return runs


# ------------------------------------------------------------------------------------------- the ladder


def test_a_best_at_the_top_edge_plans_x4_first_and_the_study_waits(tmp_path, capsys):
    x = _first_rungs(tmp_path, "flash", {0.5: 2.451, 1.0: 1.991, 2.0: 1.706})  # the first three GPU records' scores
    fixed, runs = _plan(), _plan(tmp_path)
    ids = [r.id for r in runs]
    assert len(runs) == len(fixed) + 1 and "sweep-flash-1024-lrx4" not in [r.id for r in fixed]
    x4 = runs[ids.index("sweep-flash-1024-lrx4")]
    assert (x4.kind, x4.family, x4.context, x4.seed, x4.lr_factor) == ("sweep", "flash", 1024, 0, 4.0)
    assert x4.lr == pytest.approx(4 * x[1.0].lr) and x4.init_seed == x[1.0].init_seed  # only the rate differs
    # in the plan right after the family's sweep runs, so before every study run
    assert ids.index(x4.id) == ids.index("sweep-flash-1024-lrx2") + 1
    assert ids.index(x4.id) < min(i for i, r in enumerate(runs) if r.kind == "study")
    # the family's study waits for it, whichever plan the caller holds
    for plan in (runs, fixed):
        lr, why = study.swept_lr("flash", plan, tmp_path)
        assert lr is None and "sweep-flash-1024-lrx4 not run" in why and "x2, is at the top edge" in why
    # the scheduler's next run is it
    _, _, pending = study.next_plan(False, None, tmp_path, set())
    assert pending[0].id == x4.id
    # --list shows it and counts it
    assert study.main(["--list", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert any(ln.startswith("sweep-flash-1024-lrx4 ") and "ladder extension" in ln for ln in out.splitlines())
    assert f"\n{len(fixed) + 1} runs;" in out and "learning-rate ladder (flash): waits" in out
    # --only sweep / flash select it too
    assert x4.id in [r.id for r in study.select(runs, "sweep")] and x4.id in [r.id for r in study.select(runs, "flash")]


def test_x4_better_plans_x8_and_x8_better_is_chosen_at_the_cap(tmp_path):
    x = _first_rungs(tmp_path, "flash", {0.5: 2.45, 1.0: 1.99, 2.0: 1.71})
    x4 = _rung(tmp_path, "flash", 4.0)
    _write(tmp_path, x4, _record(x4, 1.60))
    x8 = _rung(tmp_path, "flash", 8.0)
    ids = [r.id for r in _plan(tmp_path)]
    assert x8 is not None and x8.id == "sweep-flash-1024-lrx8" and x8.lr == pytest.approx(8 * x[1.0].lr)
    assert ids.index(x8.id) == ids.index(x4.id) + 1
    lr, why = study.swept_lr("flash", _plan(tmp_path), tmp_path)
    assert lr is None and "sweep-flash-1024-lrx8 not run" in why
    # x8 better still: the next rung, x16, is past the cap, so x8 is chosen and the study proceeds
    _write(tmp_path, x8, _record(x8, 1.55))
    runs = _plan(tmp_path)
    assert _rung(tmp_path, "flash", 16.0) is None and len(runs) == len(_plan()) + 2
    lr, why = study.swept_lr("flash", runs, tmp_path)
    assert lr == pytest.approx(8 * x[1.0].lr) and "sweep-flash-1024-lrx8" in why and "at the cap" in why
    _, _, pending = study.next_plan(False, None, tmp_path, set())
    assert not any(r.id.startswith("sweep-flash-") for r in pending)
    # x8 worse than x4: x4 is interior
    _write(tmp_path, x8, _record(x8, 1.65))
    lr, why = study.swept_lr("flash", _plan(tmp_path), tmp_path)
    assert lr == pytest.approx(4 * x[1.0].lr) and "x4, interior" in why


def test_an_interior_best_adds_no_rung(tmp_path):
    x = _first_rungs(tmp_path, "gla", {0.5: 2.0, 1.0: 1.8, 2.0: 1.9})
    assert [r.id for r in _plan(tmp_path)] == [r.id for r in _plan()]
    lr, why = study.swept_lr("gla", _plan(tmp_path), tmp_path)
    assert lr == x[1.0].lr and "x1, interior" in why


def test_a_best_at_the_bottom_edge_plans_x0_25_then_x0_125_at_the_cap(tmp_path):
    x = _first_rungs(tmp_path, "vq", {0.5: 1.7, 1.0: 1.9, 2.0: 2.2})
    down = _rung(tmp_path, "vq", 0.25)
    ids = [r.id for r in _plan(tmp_path)]
    assert down.id == "sweep-vq-1024-lrx0.25" and down.lr == pytest.approx(x[1.0].lr / 4)
    assert ids.index(down.id) == ids.index("sweep-vq-1024-lrx2") + 1
    lr, why = study.swept_lr("vq", _plan(tmp_path), tmp_path)
    assert lr is None and "lrx0.25 not run" in why and "bottom edge" in why
    _write(tmp_path, down, _record(down, 1.6))
    lowest = _rung(tmp_path, "vq", 0.125)
    assert lowest.id == "sweep-vq-1024-lrx0.125" and lowest.lr == pytest.approx(x[1.0].lr / 8)
    _write(tmp_path, lowest, _record(lowest, 1.5))
    assert _rung(tmp_path, "vq", 0.0625) is None
    lr, why = study.swept_lr("vq", _plan(tmp_path), tmp_path)
    assert lr == pytest.approx(x[1.0].lr / 8) and "x0.125, at the cap" in why


@pytest.mark.parametrize("how", ["diverged", "nan score"])
def test_a_diverged_rung_is_worse_than_any_finished_one_and_ends_the_ladder(tmp_path, how):
    x = _first_rungs(tmp_path, "flash", {0.5: 2.45, 1.0: 1.99, 2.0: 1.71})
    x4 = _rung(tmp_path, "flash", 4.0)
    if how == "diverged":  # lintime train stopped: run.py records "failed" with the log's tail
        _write(tmp_path, x4, _record(x4, None, status="failed", error=DIVERGED, diverged=True))
    else:  # finished, but without a finite score
        _write(tmp_path, x4, _record(x4, math.nan))
    assert _rung(tmp_path, "flash", 8.0) is None  # no rung past a diverged one
    lr, why = study.swept_lr("flash", _plan(tmp_path), tmp_path)
    assert lr == x[2.0].lr and "x2, interior" in why and "x4 diverged" in why
    # it is not run again (it would diverge again), and the family's study runs are free to start
    assert study.settled(x4, tmp_path)
    _, _, pending = study.next_plan(False, None, tmp_path, set())
    assert not any(r.id.startswith("sweep-flash-") for r in pending)


def test_a_failure_that_is_not_a_divergence_is_run_again_and_the_study_waits(tmp_path):
    _first_rungs(tmp_path, "flash", {0.5: 2.45, 1.0: 1.99, 2.0: 1.71})
    x4 = _rung(tmp_path, "flash", 4.0)
    _write(tmp_path, x4, _record(x4, None, status="failed", error="torch.OutOfMemoryError: CUDA out of memory",
                                 diverged=False))
    lr, why = study.swept_lr("flash", _plan(tmp_path), tmp_path)
    assert lr is None and "sweep-flash-1024-lrx4 failed" in why
    _, _, pending = study.next_plan(False, None, tmp_path, set())
    assert pending[0].id == x4.id


def test_a_diverged_bottom_rung_ends_the_ladder_below_and_all_diverged_chooses_nothing(tmp_path):
    x = _first_rungs(tmp_path, "transformer-pp", {0.5: 1.7, 1.0: 1.9, 2.0: 2.2})
    down = _rung(tmp_path, "transformer-pp", 0.25)
    _write(tmp_path, down, _record(down, None, status="failed", error=DIVERGED, diverged=True))
    assert _rung(tmp_path, "transformer-pp", 0.125) is None
    lr, why = study.swept_lr("transformer-pp", _plan(tmp_path), tmp_path)
    assert lr == x[0.5].lr and "x0.5, interior" in why and "x0.25 diverged" in why
    # every rung of a family diverged: no rate to choose, and no rung past them
    v = {r.lr_factor: r for r in _plan() if r.kind == "sweep" and r.family == "vq"}
    for r in v.values():
        _write(tmp_path, r, _record(r, None, status="failed", error=DIVERGED, diverged=True))
    lr, why = study.swept_lr("vq", _plan(tmp_path), tmp_path)
    assert lr is None and "ended with a finite validation score: no rate to choose" in why
    assert not any(r.family == "vq" and r.lr_factor not in v for r in _plan(tmp_path) if r.kind == "sweep")


# ------------------------------------------------------------------------------------------- the report


def test_the_sweep_table_has_a_column_per_factor_and_says_what_was_chosen(tmp_path):
    fl = _first_rungs(tmp_path, "flash", {0.5: 2.45, 1.0: 1.99, 2.0: 1.71})  # x4 better: waits for x8
    x4 = _rung(tmp_path, "flash", 4.0)
    _write(tmp_path, x4, _record(x4, 1.60))
    _first_rungs(tmp_path, "transformer-pp", {0.5: 2.0, 1.0: 1.8, 2.0: 1.9})  # interior
    gla = _first_rungs(tmp_path, "gla", {0.5: 1.7, 1.0: 1.9, 2.0: 2.2})  # bottom edge, x0.25 diverged
    g = _rung(tmp_path, "gla", 0.25)
    _write(tmp_path, g, _record(g, None, status="failed", error=DIVERGED, diverged=True))
    _first_rungs(tmp_path, "vq", {0.5: 2.4, 1.0: 2.0, 2.0: 1.8})  # x4, x8 better: x8 at the cap
    for f, v in ((4.0, 1.7), (8.0, 1.65)):
        r = _rung(tmp_path, "vq", f)
        _write(tmp_path, r, _record(r, v))
    plan = _plan(tmp_path)
    assert len(plan) == len(_plan()) + 5  # flash x4, x8; gla x0.25; vq x4, x8
    md = rep.render(tmp_path, plan, plots_dir=None)
    lines = md.split("### Context")[0].splitlines()  # the head and the sweep block
    # done: flash 4 (x0.5-x4), Transformer++ 3, GLA 3 (x0.25 failed), VQ 5 = 15 of 48 + 5
    assert lines[0].startswith(f"15 of {len(_plan()) + 5} planned runs done (17 sweep runs with 5 ladder extensions")
    assert "| family | x 0.25 | x 0.5 | x 1 | x 2 | x 4 | x 8 | chosen |" in lines
    row = {ln.split(" | ")[0][2:]: ln for ln in lines if ln.startswith("| ") and " | chosen |" not in ln}
    assert set(row) == {"FLASH", "Transformer++", "GLA", "Transformer-VQ"}
    assert row["FLASH"] == (f"| FLASH | - | 2.4500 (lr {fl[0.5].lr:.2g}) | 1.9900 (lr {fl[1.0].lr:.2g}) | 1.7100 (lr "
                            f"{fl[2.0].lr:.2g}) | 1.6000 (lr {x4.lr:.2g}) | not run | - (waits: x8 not run) |")
    assert row["Transformer++"].endswith("| 1.9000 (lr 0.0014) | - | - | 0.0007 (x1, interior) |")
    assert row["GLA"].startswith("| GLA | diverged | 1.7000 (lr 0.00015) |")
    assert row["GLA"].endswith("| 0.00015 (x0.5, interior) |") and gla[0.5].lr == pytest.approx(0.00015)
    assert row["Transformer-VQ"].endswith("| 1.6500 (lr 0.0032) | 0.0032 (x8, at the cap) |")
    # the sentence above the table states the rule
    assert "adaptive ladder" in md and "within x 0.125 to x 8 (the cap)" in md and "worse than any finished one" in md
    assert "Sweep runs skip retrieval by the plan" in md


def test_the_gpu_sweep_records_drive_the_ladder_to_its_cap(tmp_path):
    """The committed GPU records of FLASH's sweep at 2^16 tokens a step (x1 / 2 / 4 / 8: validation 1.4710 / 1.3748 /
    1.3518 / 1.3418 bits per byte; their retrieval "not run" by the sweep rule) read through the ladder and the report.
    Without x0.5 the ladder waits for it, x4 and x8 on it already (they have records); with an x0.5 record (typed in,
    worse) its best, x8, is at the cap.  Copies, so that later records do not change what is tested."""
    for f in ("1", "2", "4", "8"):
        name = f"sweep-flash-1024-lrx{f}.json"
        (tmp_path / name).write_text((study.RUNS / name).read_text())
    recs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert all(r["run"]["tokens_per_batch"] == study.TOKENS_PER_BATCH for r in recs.values())
    assert all(c["status"] == "not run" for r in recs.values() for c in r["retrieval"]["cells"])
    plan = _plan(tmp_path)
    assert study.sweep_ladder("flash", plan, tmp_path).state == "waits"
    assert "| FLASH | not run | 1.4710 (lr 0.0007) | 1.3748 (lr 0.0014) | 1.3518 (lr 0.0028) | 1.3418 (lr 0.0056) | " \
           "- (waits: x0.5 not run) |" in rep.render(tmp_path, plan, plots_dir=None)
    x05 = next(r for r in plan if r.id == "sweep-flash-1024-lrx0.5")
    _write(tmp_path, x05, _record(x05, 1.6))
    plan = _plan(tmp_path)
    lad = study.sweep_ladder("flash", plan, tmp_path)
    assert [r.lr_factor for r in lad.rungs] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert (lad.state, lad.best.id) == ("at the cap", "sweep-flash-1024-lrx8")
    assert study.swept_lr("flash", plan, tmp_path)[0] == pytest.approx(8 * x05.lr / 0.5)
    assert "| FLASH | 1.6000 (lr 0.00035) | 1.4710 (lr 0.0007) |" in rep.render(tmp_path, plan, plots_dir=None)
    # the retrieval table holds the study runs only: the sweep records' entries do not show there
    tab = rep.retrieval_table(rep.load(tmp_path, plan), plan)
    assert all(not c["acc"] for stages in tab["rows"][1024].values() for cells in stages.values()
               for c in cells.values())


# ------------------------------------------------------------------------------------------- no retrieval on sweeps


def test_a_sweep_runs_estimate_leaves_out_the_retrieval_reserve():
    by = {r.id: r for r in _plan()}
    sweep, stud = by["sweep-flash-1024-lrx1"], by["flash-1024-s0"]  # the same family, context and tokens
    assert sweep.est_s == stud.est_s and sweep.no_retrieval_why and stud.no_retrieval_why is None
    assert study.start_estimate(sweep, "cuda") == study.start_estimate(stud, "cuda", retrieval=False)
    assert study.start_estimate(stud, "cuda") > study.start_estimate(sweep, "cuda")
    assert sweep.retrieval_ft_s == 0.0 < stud.retrieval_ft_s and sweep.est_ft_device_s == 0.0
    assert sweep.est_device_s < stud.est_device_s


WORDS = "alpha beta gamma delta kernel schema façade naïve über token stream buffer".split()


def test_a_smoke_sweep_run_records_why_it_skips_retrieval(tmp_path):
    from lintime.data import prepare

    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    for i in range(120):
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 160))]
        (corpus / f"doc{i:04d}.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    prepare(str(corpus), "byte", tmp_path / "data" / "cache", quiet=True)
    rid = "sweep-transformer-pp-128-lrx0.5"
    assert study.main(["--smoke", "--only", rid, "--data", str(tmp_path / "data"), "--runs-dir", str(tmp_path / "runs"),
                       "--work", str(tmp_path / "work"), "--device", "cpu"]) == 0
    rec = json.loads((tmp_path / "runs" / f"{rid}.json").read_text())
    assert rec["status"] == "done", rec.get("error")
    why = "sweep run: retrieval is measured on the study runs"
    assert rec["retrieval"]["cells"] and all(c["status"] == "not run" and c["why"] == why
                                             for c in rec["retrieval"]["cells"])
    assert rec["retrieval_ft"]["status"] == "not run" and rec["retrieval_ft"]["why"] == why
    assert all(c["status"] == "not run" for c in rec["retrieval_ft"]["retrieval"]["cells"])
