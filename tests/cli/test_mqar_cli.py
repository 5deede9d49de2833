"""What a new user met with ``lintime train --task mqar`` (issue 40): one test per finding, each
reproducing what the user did.  Tiny settings (width 16, 32 tokens, a few thousand examples) except
the docs' example, which is run as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lintime.cli import main
from lintime.training import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _mqar(out: Path, name: str, *extra: str) -> list[str]:
    return ["train", "--task", "mqar", "--preset", "transformer-pp-tiny", "--n-heads", "1", "--position", "none",
            "--d-model", "16", "--context-len", "32", "--kv-pairs", "4", "--device", "cpu", "--out", str(out),
            "--name", name, *extra]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# --- 1: the run said nothing for minutes: its plan up front, then progress -----------------------

def test_mqar_training_prints_its_plan_and_shows_progress(tmp_path, capsys, monkeypatch):
    from lintime.training import trainer

    # stderr is no terminal here: the plain progress line, every step instead of every 30 s
    monkeypatch.setattr(trainer, "PROGRESS_EVERY_S", 0.0)
    examples, rows, epochs = 256, 8, 2  # 32 steps an epoch: the time estimate (step 21) comes within the first
    flags = ["--examples", str(examples), "--tokens-per-batch", str(rows * 32), "--epochs", str(epochs)]
    assert main(_mqar(tmp_path, "a", *flags)) == 0
    cap = capsys.readouterr()
    per_epoch = examples // rows
    plan = re.search(r"plan: ([\d,]+) steps \(([\d.]+) epochs of (\d+) steps\)", cap.out)
    assert plan, cap.out
    assert int(plan[1].replace(",", "")) == epochs * per_epoch and float(plan[2]) == epochs and int(plan[3]) == per_epoch
    # the plan line comes before the first epoch's line; a time estimate after the first steps
    assert cap.out.index("plan:") < cap.out.index("epoch      1")
    timing = re.search(r"timing: ([\d.e-]+) s per step: the plan's [\d,]+ steps take ~", cap.out)
    assert timing and float(timing[1]) > 0, cap.out
    seen = [(int(m[1]), int(m[2])) for m in re.finditer(r"train: step (\d+)/(\d+)", cap.err)]
    assert seen and all(total == epochs * per_epoch for _, total in seen), cap.err
    steps = [s for s, _ in seen]
    assert steps == sorted(steps) and steps[-1] == len(_rows(tmp_path / "a")) * per_epoch

    # --no-progress reaches the task path: no progress lines (with progress every step, any run that takes a step
    # would print one: one epoch of 8 steps is enough)
    short = ["--examples", "64", "--tokens-per-batch", str(rows * 32), "--epochs", "1"]
    assert main(_mqar(tmp_path, "b", *short, "--no-progress")) == 0
    cap = capsys.readouterr()
    assert "plan:" in cap.out and "train: step" not in cap.err, cap.err


# --- 2: Ctrl-C / SIGTERM left no checkpoint and an empty metrics.jsonl ----------------------------

def test_a_signal_scores_and_saves_the_mqar_run(tmp_path):
    """SIGTERM here; SIGINT goes through the same handler (lintime/training/runguard.py ``StopSignals`` takes both) and
    is sent to a real ``lintime train`` in tests/cli/test_new_user.py."""
    sig = signal.SIGTERM
    run = tmp_path / "runs" / "r"
    per_epoch = 8192 // 8
    args = _mqar(tmp_path / "runs", "r", "--examples", "8192", "--tokens-per-batch", str(8 * 32), "--no-progress")
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
        proc = subprocess.Popen([sys.executable, "-m", "lintime", *args], stdout=out_f, stderr=err_f, env=ENV)
        try:
            t0 = time.time()
            # it has taken steps: its time estimate (after the first steps) or an epoch's row
            while "timing:" not in out_path.read_text() and not _rows(run):
                assert proc.poll() is None, err_path.read_text()
                assert time.time() - t0 < 240, "the run did not start"
                time.sleep(0.1)
            proc.send_signal(sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = err_path.read_text()
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lintime: stopped by {signal.Signals(sig).name} "), err
    line = lines[0]
    loaded = ckpt.load_model(run)
    assert 0 < loaded.step < 64 * per_epoch and ckpt.verify_checkpoint(ckpt.resolve_checkpoint(run)) is None
    assert f"checkpoint {run}" in line and ckpt.step_dir_name(loaded.step) in line, line
    # every step taken is scored: the last metrics row is at the saved step (a partial epoch's, when
    # the signal came mid-epoch)
    rows = _rows(run)
    assert rows and rows[-1]["step"] == loaded.step and 0 <= rows[-1]["val_accuracy"] <= 1
    if loaded.step % per_epoch:
        assert rows[-1]["epoch"] == pytest.approx(loaded.step / per_epoch, abs=1e-4)
    # the line says how to score it, and that command scores it
    suggested = re.search(r"lintime eval (\S+) --task mqar", line)
    assert suggested and "not resumable" in line, line
    assert main(["eval", suggested[1], "--task", "mqar", "--examples", "50", "--no-progress"]) == 0


# --- 3: the docs' example planned 12 480 steps (~2 hours on a CPU) ---------------------------------

def _doc_commands() -> list[list[str]]:
    text = (REPO / "docs" / "cli.md").read_text()
    section = text[text.index("### Synthetic recall: `--task mqar`"):]
    section = section[:section.index("\n### ", 1)]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [shlex.split(cmd) for cmd in block.replace("\\\n", " ").splitlines() if cmd.strip()]


def test_the_docs_mqar_example_finishes_in_about_a_minute(tmp_path, capsys, monkeypatch):
    commands = _doc_commands()
    train = next(c for c in commands if c[:2] == ["lintime", "train"])
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "lintime", *train[1:]], cwd=tmp_path, env=ENV,
                              capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the docs' example ran past 150 s: {shlex.join(train)}")
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    assert seconds < 150
    out = train[train.index("--out") + 1]
    run = tmp_path / out / train[train.index("--name") + 1]
    rows = _rows(run)
    assert rows and rows[-1]["val_accuracy"] > 0.99, rows  # it learns the lookup, as the doc says
    for cmd in commands:
        if cmd[:2] == ["lintime", "eval"]:
            # in this process (the train command above is the real one the time claim is about): relative paths as
            # the docs' commands run from the folder of the train command
            monkeypatch.chdir(tmp_path)
            assert main([*cmd[1:], "--no-progress"]) == 0
            stdout = capsys.readouterr().out
            table = stdout.splitlines()
            head = next(i for i, ln in enumerate(table) if ln.split()[:1] == ["seq_len"])
            acc = float(table[head + 1].split()[table[head].split().index("accuracy")])
            assert acc > 0.99, stdout


# --- 4: eval called the task's vocabulary "byte tokenizer" -------------------------------------------

def test_eval_of_an_mqar_run_names_the_tasks_vocabulary(tmp_path, capsys):
    assert main(_mqar(tmp_path, "v", "--task-vocab", "96", "--examples", "512", "--steps", "2", "--no-progress")) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "v"), "--task", "mqar", "--examples", "50", "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "byte" not in header and "tokenizer" not in header, header
    assert re.search(r"\bmqar vocabulary 96\b", header), header
