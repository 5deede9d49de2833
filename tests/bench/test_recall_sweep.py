"""benchmarks/recall_sweep.py on the CPU: the tiny sweep covers every registered family; the
learning-rate ladder, the deadline and the worker pool; the page generator fills
docs/results_recall.md's blocks from the JSON."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import recall_sweep as rs  # noqa: E402


def test_tiny_sweep_covers_every_family(tmp_path):
    assert rs.main(["--tiny", "--widths", "16", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "recall_sweep.json").read_text())
    families = set(rs.family_presets())
    assert {r["family"] for r in data["best"]} == families and len(families) >= 9
    assert len(data["runs"]) == len(families) and data["not_run"] == []  # one width, one point, one rate
    failed = [r for r in data["runs"] if "error" in r]
    assert not failed, failed
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 1 and r["stopped"] == "epochs" for r in data["runs"])
    soft = [r for r in data["runs"] if r["family"] == "softmax"]
    assert all(r["n_heads"] == 1 and r["position"] == "none" for r in soft)
    assert data["runs"][0]["family"] == "softmax"  # the anchor goes first
    table = (tmp_path / "recall_sweep.md").read_text()
    assert table.count("| 16 / 2 |") == len(families)
    assert (tmp_path / "recall_sweep.png").stat().st_size > 1000
    assert not (tmp_path / "runs").exists()  # run folders are temporary unless --keep-runs


def _cells(families=("gla", "softmax"), widths=(64, 128)):
    return rs.make_cells({f: f"{f}-tiny" for f in families}, [(64, 4), (128, 8)], list(widths))


def test_ladder_order_and_next_rate_only_below_the_target():
    cells = _cells()
    ladder = rs.Ladder(cells, [1e-3, 1e-2, 1e-4])
    first = [ladder.next() for _ in range(len(cells))]
    # the anchor's cells first, then the others in the grid's order (narrow widths, then short sequences)
    assert [t.cell.family for t in first] == ["softmax"] * 4 + ["gla"] * 4
    assert [(t.cell.d_model, t.cell.seq_len) for t in first[4:]] == [(64, 64), (64, 128), (128, 64), (128, 128)]
    assert all(t.rung == 0 and t.lr == 1e-3 for t in first) and ladder.next() is None
    solved, unsolved, cut, broken = first[4], first[5], first[6], first[7]
    ladder.done(solved, 0.995)
    ladder.done(unsolved, 0.99)  # not above the target: the next rate
    ladder.done(cut, 0.3, retry=False)  # stopped by the deadline
    ladder.done(broken, None)  # a diverged run: the next rate
    ladder.done(first[0], 0.2)  # an anchor cell: its next rate before any other family's
    pend = ladder.pending()
    assert [(t.cell.family, t.cell.key, t.rung, t.lr) for t in pend] == [
        ("softmax", first[0].cell.key, 1, 1e-2), ("gla", unsolved.cell.key, 1, 1e-2), ("gla", broken.cell.key, 1, 1e-2)]
    task = ladder.next()
    ladder.done(task, 0.5)
    # the anchor's third rate waits until the others' second rates have run
    assert [(t.cell.family, t.rung) for t in ladder.pending()] == [("gla", 1), ("gla", 1), ("softmax", 2)]
    for t in (ladder.next(), ladder.next()):
        ladder.done(t, 0.995)
    last = ladder.next()
    assert last.cell == first[0].cell and last.rung == 2 and last.lr == 1e-4
    ladder.done(last, 0.4)  # the last rung: nothing more
    assert ladder.pending() == [] and ladder.best[first[0].cell.key] == 0.5


def test_in_process_deadline_records_what_ran():
    """A fake runner on a fake clock: each run takes 10 s; the deadline at 35 s with 5 s minimum
    leaves room for three runs, each given the time left; the rest stays queued."""
    now = [0.0]
    given = []

    def runner(task, left):
        given.append(left)
        now[0] += 10.0
        return {**rs._task_row(task), "accuracy": 0.5, "steps": 1, "stopped": "max_steps", "wall_seconds": 10.0}

    ladder = rs.Ladder(_cells(), [1e-3, 1e-2])
    runs = rs.sweep_in_process(ladder, runner, 35.0, min_run_s=5.0, say=lambda line: None, clock=lambda: now[0])
    assert len(runs) == 3 and given == [35.0, 25.0, 15.0]
    pend = ladder.pending()
    assert len(pend) == 8 - 3 + 3  # five first rungs not run, three second rungs queued
    best = rs.best_by_cell(runs, _cells())
    assert sum(r["status"] == rs.NOT_RUN for r in best) == 5 and sum(r["status"] == "done" for r in best) == 3
    assert "not run" in rs.table(best)


def test_best_rate_per_cell_and_the_anchor_verdict():
    row = dict(preset="x", seq_len=64, kv_pairs=4)
    runs = [
        {"family": "gla", "d_model": 64, "lr": 1e-3, "accuracy": 0.4, "stopped": "max_steps", **row},
        {"family": "gla", "d_model": 64, "lr": 1e-2, "accuracy": 0.7, "stopped": "max_seconds", **row},
        {"family": "gla", "d_model": 64, "lr": 1e-1, "error": "x", **row},
        {"family": "vq", "d_model": 64, "lr": 1e-3, "error": "boom", **row},
        {"family": "softmax", "d_model": 64, "lr": 1e-3, "accuracy": 0.95, "stopped": "max_steps", **row},
        {"family": "softmax", "d_model": 128, "lr": 1e-3, "accuracy": 0.996, "stopped": "early stop", **row},
    ]
    best = {(r["family"], r["d_model"]): r for r in rs.best_by_cell(runs)}
    gla = best["gla", 64]
    assert (gla["accuracy"], gla["lr"], gla["rates"], gla["partial"]) == (0.7, 1e-2, 3, True)
    assert best["vq", 64]["accuracy"] is None and best["vq", 64]["status"] == "failed"
    text = rs.table(list(best.values()))
    assert "| vq | 64 / 4 | failed |" in text and "0.700†" in text
    (verdict,) = rs.anchor_verdict(list(best.values()))
    assert verdict["passes"] and verdict["d_model"] == 128 and verdict["widths_above"] == [128]
    assert not rs.anchor_verdict([best["softmax", 64]])[0]["passes"]


def test_pool_runs_tiny_points_and_kills_at_the_deadline(tmp_path):
    """A spawned worker runs two tiny points one after the other; a pool whose deadline has passed
    kills the run it started (a worker still importing torch) and records it."""
    assert rs.main(["--tiny", "--widths", "16,32", "--families", "gla", "--jobs", "1",
                    "--out", str(tmp_path / "a")]) == 0
    data = json.loads((tmp_path / "a" / "recall_sweep.json").read_text())
    assert sorted(r["d_model"] for r in data["runs"]) == [16, 32] and data["jobs"] == 1
    assert all("error" not in r and r["steps"] == 1 and r["step"] == "off" for r in data["runs"])
    assert rs.main(["--tiny", "--widths", "16", "--families", "gla", "--jobs", "1", "--deadline-s", "0.5",
                    "--min-run-s", "0", "--grace-s", "0", "--out", str(tmp_path / "b")]) == 0
    data = json.loads((tmp_path / "b" / "recall_sweep.json").read_text())
    assert [r["error"] for r in data["runs"]] == [rs.KILLED]
    assert data["best"][0]["status"] == "killed" and "| gla | 16 / 2 | killed |" in rs.table(data["best"])


def _settings(**kw) -> dict:
    base = dict(vocab=32, rows=8, train_examples=64, test_examples=16, epochs=1, steps=6, anchor_steps=None,
                eval_every=3, seed=0, device="cpu", precision="auto", keep_runs=False)
    return {**base, **kw}


def _run_worker(tasks, settings, root, share=None):
    """``_worker`` in a thread of this process: the tasks sent at once, the records read back."""
    import threading
    import time
    from multiprocessing import Pipe

    parent, child = Pipe()
    thread = threading.Thread(target=rs._worker, args=(child, settings, str(root)), daemon=True)
    thread.start()
    for i, task in enumerate(tasks):
        parent.send((i, task, time.time() + 60, share, None))
    got = {}
    while len(got) < len(tasks):
        assert parent.poll(60), got
        tid, row, leave = parent.recv()
        got[tid] = (row, leave)
        if leave:
            break
    if not any(leave for _, leave in got.values()):
        parent.send(None)
    thread.join(30)
    assert not thread.is_alive()
    return got


def test_worker_trains_its_runs_in_order_like_runs_alone(tmp_path):
    """Three runs through one worker, one after the other, the training examples shared: each record
    is its task's, and equals the run trained alone (bitwise: the same steps on the same batches)."""
    tasks = [rs.Task(c, 0, 3e-3) for c in rs.make_cells({"gla": "gla-tiny", "softmax": "transformer-pp-tiny"},
                                                        [(16, 2)], [16, 32])][:3]
    got = _run_worker(tasks, _settings(), tmp_path / "w")
    assert sorted(got) == [0, 1, 2]
    for i, task in enumerate(tasks):
        row, leave = got[i]
        assert not leave and "error" not in row, row
        assert (row["family"], row["d_model"], row["steps"]) == (task.cell.family, task.cell.d_model, 6)
        alone = rs.run_task(task, _settings(), str(tmp_path / "alone"))
        assert (alone["accuracy"], alone["steps"]) == (row["accuracy"], row["steps"])


def test_worker_with_a_cuda_error_sends_its_record_and_leaves(tmp_path, monkeypatch):
    """A run that fails with a CUDA error may have poisoned the process: its worker sends the failed
    run with ``leave`` and exits, after the run before it went through normally."""
    from lintime.training.tasks import TaskRun

    real = TaskRun.advance

    def advance(self, max_steps=None):
        if self.cfg.d_model == 32:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, max_steps)

    monkeypatch.setattr(TaskRun, "advance", advance)
    tasks = [rs.Task(c, 0, 3e-3) for c in rs.make_cells({"gla": "gla-tiny"}, [(16, 2)], [16, 32])]
    got = _run_worker(tasks, _settings(), tmp_path)
    (ok, ok_leave), (bad, bad_leave) = got[0], got[1]
    assert "error" not in ok and not ok_leave
    assert bad["error"].startswith("RuntimeError: CUDA error") and bad_leave and not bad["diverged"]


def test_pool_retries_a_failed_capture_eagerly_in_a_fresh_worker(tmp_path):
    """``--graph capture`` on a CPU: the step cannot be built (a CUDA graph needs CUDA), which the
    worker treats as a failed capture -- it sends the record and exits; a fresh worker then trains
    the run with the plain loop, and the record keeps the first try's error."""
    assert rs.main(["--tiny", "--widths", "16", "--families", "gla", "--jobs", "1", "--graph", "capture",
                    "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "recall_sweep.json").read_text())
    (run,) = data["runs"]
    assert "error" not in run and run["step"] == "off" and run["steps"] == 1
    assert run["first_try"].startswith("ValueError: a CUDA graph needs a CUDA model")
    s = data["summary"]
    assert (s["finished"], s["killed"], s["failed"], s["retried_eagerly"], s["steps"]) == (1, 0, 0, 1, 1)


def test_worker_share_counts_from_the_first_step(tmp_path):
    """A share of 0 s: the run takes its first step (build, compiles and capture are not counted),
    then one more before it sees the limit, and is scored there; the record says where its time
    went."""
    (task,) = [rs.Task(c, 0, 3e-3) for c in rs.make_cells({"gla": "gla-tiny"}, [(16, 2)], [16])]
    row, leave = _run_worker([task], _settings(steps=50, eval_every=25), tmp_path, share=0.0)[0]
    assert not leave and (row["steps"], row["stopped"]) == (2, "max_seconds")
    assert row["step"] == "off" and all(row[k] >= 0 for k in ("setup_s", "first_step_s", "eval_s", "train_seconds"))


def test_time_shares_spread_the_deadline_over_the_first_rung():
    """Rule: the shares of the first rung's runs and their overheads add up to the workers' time
    to the deadline less the reserve, the anchor's share in proportion to its step budget."""
    cells = _cells()  # 4 softmax (anchor) + 4 gla cells
    settings = {"steps": 1000, "anchor_steps": 3000}
    other, anchor = rs.time_shares(cells, settings, jobs=5, deadline_s=300.0)
    assert anchor == pytest.approx(3 * other)
    assert 4 * other + 4 * anchor + 8 * rs.RUN_OVERHEAD_S == pytest.approx(5 * (300.0 - rs.SHARE_RESERVE_S))


def test_summary_counts_and_the_smoke_verdict():
    runs = [{"steps": 100, "step": "capture", "accuracy": 0.5, "stopped": "max_steps"},
            {"steps": 40, "step": "off", "accuracy": 0.1, "stopped": "max_seconds", "first_try": "CaptureFailed: x"},
            {"steps": 9, "step": "capture", "error": "ValueError: training diverged by step 9", "diverged": True},
            {"error": rs.KILLED}]
    s = rs.summarize(runs, [{}], 10.0)
    assert (s["finished"], s["killed"], s["failed"], s["diverged"], s["not_started"]) == (2, 1, 1, 1, 1)
    assert (s["steps"], s["steps_per_s"], s["capped"], s["retried_eagerly"]) == (149, 14.9, 1, 1)
    assert s["step_forms"] == {"capture": 2, "off": 1}
    assert "2 runs finished" in rs.summary_line(s) and "15 steps/s" in rs.summary_line(s)
    assert not rs.healthy(s) and rs.healthy(rs.summarize(runs[:3], [], 10.0))
    assert not rs.healthy(rs.summarize(runs[:1] + [{"error": "RuntimeError: CUDA error: x"}], [], 1.0))


def test_deadline_before_any_run(tmp_path):
    assert rs.main(["--tiny", "--widths", "16", "--deadline-s", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "recall_sweep.json").read_text())
    assert data["runs"] == [] and len(data["not_run"]) == len(rs.family_presets())
    assert all(r["status"] == rs.NOT_RUN for r in data["best"])


def _passkey_json(path: Path) -> Path:
    cells = [{"context_len": L, "depth": d, "trials": 4, "correct": c, "accuracy": c / 4, "seconds": 0.1, "answers": [],
              "skipped": None} for L, d, c in [(1024, 0.0, 4), (1024, 1.0, 2), (2048, 0.0, 1), (2048, 1.0, 0)]]
    data = {"date": "2026-11-27 03:00 UTC", "commit": "abcdef1234567", "device": "NVIDIA H100", "torch": "2.x",
            "seconds": 12.0, "settings": {"lengths": [1024, 2048, 4096], "depths": [0.0, 1.0], "trials": 4, "digits": 5,
                                          "filler": "stdlib (test split)"},
            "models": [{"name": "flash-1024", "trained_context": 1024, "cells": cells, "not_run": [4096]},
                       {"name": "linear-1024", "trained_context": 1024, "error": "ValueError: no checkpoint", "cells": []}]}
    path.write_text(json.dumps(data))
    return path


def test_report_fills_the_page(tmp_path):
    """--report on a copy of the real page: the status, results and passkey blocks are replaced,
    the rest of the page is kept, the plots are drawn from the JSON beside it."""
    out = tmp_path / "sweep"
    assert rs.main(["--tiny", "--widths", "16", "--families", "softmax,gla", "--epochs", "10", "--steps", "3",
                    "--anchor-steps", "5", "--out", str(out)]) == 0
    runs = {r["family"]: r for r in json.loads((out / "recall_sweep.json").read_text())["runs"]}
    assert (runs["softmax"]["budget"], runs["softmax"]["steps"], runs["gla"]["budget"], runs["gla"]["steps"]) == (5, 5, 3, 3)
    page = tmp_path / "docs" / "results_recall.md"
    page.parent.mkdir()
    shutil.copy(ROOT / "docs" / "results_recall.md", page)
    before = page.read_text()
    pk = _passkey_json(tmp_path / "passkey_sweep.json")
    assert rs.main(["--report", str(out / "recall_sweep.json"), "--passkey", str(pk), "--page", str(page)]) == 0
    text = page.read_text()
    assert "Not yet run. MQAR" not in text and "**Status:** the MQAR sweep ran on" in text
    assert "| gla | 16 / 2 |" in text and "| softmax | 16 / 2 |" in text
    assert "The anchor does not pass at 16 / 2" in text  # five steps of a tiny model solve nothing
    assert "3 steps per run (5 for the anchor" in text
    assert "| flash-1024 | 1024 | 0.75 | 0.12 | not run |" in text  # 6/8 and 1/8 correct over the depths
    assert "| linear-1024 | 1024 | failed | failed | failed |" in text
    assert (page.parent / "results" / "recall_sweep.png").stat().st_size > 1000
    assert (page.parent / "results" / "passkey_sweep.png").stat().st_size > 1000
    assert json.loads((page.parent / "results" / "recall_sweep.json").read_text())["best"]
    assert json.loads((page.parent / "results" / "passkey_sweep.json").read_text())["models"][0]["name"] == "flash-1024"
    # the hand-written parts are untouched; a second report replaces the blocks, not appends
    assert before.split("<!-- BEGIN status")[0] == text.split("<!-- BEGIN status")[0]
    assert text.count("## The recipe") == 1
    assert rs.main(["--report", str(out / "recall_sweep.json"), "--page", str(page)]) == 0
    assert page.read_text().count("| gla | 16 / 2 |") == 1 and "flash-1024" in page.read_text()


def test_page_markers_are_checked():
    with pytest.raises(ValueError, match="block markers"):
        rs.replace_block("no markers here", "status", "x")
    text = "a\n" + rs.BEGIN.format(name="s") + "\nold\n" + rs.END.format(name="s") + "\nb\n"
    assert rs.replace_block(text, "s", "new").split("\n")[2] == "new"


def test_retry_book_sends_failed_graph_steps_eagerly():
    """A failed capture: retried eagerly once, and its family and width go eager from the start; a
    captured step that diverged: retried eagerly once -- a divergence the eager run repeats is the
    rate's (nothing changes), one it does not is the graph's (that family and width go eager); an
    eager run that fails is recorded, not retried."""
    c64, c128, c256 = rs.make_cells({"vq": "vq-tiny"}, [(64, 4)], [64, 128, 256])
    a, b, c, d = rs.Task(c64, 0, 1e-3), rs.Task(c64, 1, 1e-2), rs.Task(c128, 0, 1e-3), rs.Task(c256, 0, 1e-3)
    book = rs.RetryBook()
    assert book.after(a, {"error": "CaptureFailed: the step does not capture", "step": "capture"}, True)
    assert book.plain(a) and book.plain(b) and not book.plain(c)  # b: the same family and width
    assert not book.after(a, {"error": "RuntimeError: CUDA error: x", "step": "off"}, True)  # tried eagerly already
    assert book.first_try(a).startswith("CaptureFailed") and book.first_try(a) is None
    row_b = {"accuracy": 0.5, "step": "off"}
    assert not book.after(b, row_b, False) and row_b["step"].startswith("off (its family's graph step failed")
    nan = {"error": "ValueError: training diverged by step 9 (mean loss nan)", "diverged": True, "step": "capture"}
    assert book.after(c, dict(nan), False) and book.plain(c)
    assert not book.after(c, {**nan, "step": "off"}, False)  # diverged eagerly too: the rate's
    assert not book.plain(rs.Task(c128, 1, 1e-2))
    assert book.after(d, dict(nan), False) and not book.after(d, {"accuracy": 0.3, "step": "off"}, False)
    assert book.plain(rs.Task(d.cell, 1, 1e-2))  # the eager run did not diverge: the graph's
    assert not book.after(rs.Task(c128, 2, 1e-4), {"accuracy": 0.1, "step": "capture"}, False)
