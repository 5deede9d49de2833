"""``lintime train`` and ``lintime data`` end to end: the files a run leaves, and user errors as one
line with exit status 2 (no traceback, no half-made run folder)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lintime.cli import main
from lintime.cli.train import train as train_command
from lintime.training import TrainConfig, load_model

REPO = Path(__file__).resolve().parents[2]


def _write_corpus(root: Path, n_files: int = 120) -> Path:
    for i in range(n_files):
        body = "".join(f"def f{j}_{i}(x):\n    return x * {j} + {i % 7}\n\n" for j in range(1 + i % 5))
        path = root / f"pkg{i % 3}" / f"m{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    return root



@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _tiny(corpus, cache, out, *extra):
    return ["train", "--preset", "transformer-pp-tiny", "--corpus", str(corpus), "--cache-dir", str(cache),
            "--context-len", "32", "--tokens-per-batch", "128", "--eval-tokens", "256", "--sample-tokens", "12",
            "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus, cache):
    out = tmp_path_factory.mktemp("runs")
    torch.set_num_threads(1)
    rc = main(_tiny(corpus, cache, out, "--steps", "4", "--micro-batch-tokens", "64", "--eval-every", "2",
                    "--save-every", "2", "--keep", "1", "--name", "e2e"))
    assert rc == 0
    return out / "e2e"


def test_defaults_are_a_tiny_flash_on_the_stdlib():
    params = inspect.signature(train_command).parameters
    assert params["preset"].default == "flash-tiny" == TrainConfig().preset
    assert params["corpus"].default == "stdlib" and params["tokenizer"].default == "byte"
    assert params["objective"].default == "clm" and params["recipe"].default is None  # the preset family's
    # every TrainConfig field is a flag (two under a shorter name), with the same default
    flags = {"time": "time_minutes", "prompt": "sample_prompt"}
    fields = {f for f in TrainConfig.__dataclass_fields__}
    assert {flags.get(p, p) for p in params} >= fields
    for p in params:
        f = flags.get(p, p)
        if f in fields and params[p].default is not None:
            assert params[p].default == getattr(TrainConfig(), f), p


def test_the_default_preset_trains(tmp_path, corpus, cache, capsys):
    args = _tiny(corpus, cache, tmp_path, "--steps", "2", "--name", "default")
    args = args[:1] + args[3:]  # no --preset: the default, flash-tiny
    assert main(args) == 0
    assert json.loads((tmp_path / "default" / "config.json").read_text())["model"]["family"] == "flash"
    assert "validation:" in capsys.readouterr().out


def test_a_run_leaves_every_file(finished_run, capsys):
    run = finished_run
    for name in ("config.json", "tokenizer", "metrics.jsonl", "metrics.csv", "loss_vs_steps.png",
                 "loss_vs_time.png", "sample.txt", "checkpoints/latest"):
        assert (run / name).exists(), name
    assert [p.name for p in (run / "checkpoints").iterdir() if p.is_dir()] == ["step_00000004"]  # --keep 1
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    config = json.loads((run / "config.json").read_text())
    assert config["objective"] == "clm" and config["tokenizer"] == "byte"
    assert config["train"]["micro_batch_tokens"] == 64 and config["train"]["lr"] == 3e-3  # resolved: a tiny model's rate
    assert config["model"]["vocab_size"] == 260  # the tokenizer's vocabulary
    state = torch.load(run / "checkpoints" / "step_00000004" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["tokens"] == 512 and set(state) >= {"optimizer", "data", "rng", "elapsed_s", "scheduler"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert all(set(r) >= {"tokens", "time_s", "lr", "grad_norm"} for r in rows if "loss" in r)
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:7] == ["step", "tokens", "time_s", "loss", "aux_loss", "lr", "grad_norm"] and "val_bpb" in header
    assert (run / "loss_vs_steps.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "sample.txt").read_text().startswith("def ")
    loaded = load_model(run)
    assert loaded.step == 4 and loaded.tokenizer.name == "byte"


def test_resume_continues_a_finished_run(finished_run, corpus, cache, capsys):
    rc = main(_tiny(corpus, cache, finished_run.parent, "--resume", str(finished_run), "--steps", "5"))
    assert rc == 0
    assert "resuming at step 4" in capsys.readouterr().out
    assert load_model(finished_run).step == 5


def _one_line_error(capsys, rc):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("lintime") and "error" in err[0], err
    return err[0]


@pytest.mark.parametrize("args, message", [
    (["--corpus", "/no/such/corpus"], "corpus not found"),
    (["--preset", "no-such-model"], "unknown preset"),
    (["--steps", "-3"], "steps must be an integer >= 1"),
    (["--context-len", "0"], "context_len must be an integer >= 1"),
    (["--tokens-per-batch", "100"], "multiple of context_len"),
    (["--micro-batch-tokens", "96"], "must divide tokens_per_batch"),
    (["--recipe", "sgd"], "unknown recipe"),
    (["--lr", "-1"], "lr must be > 0"),
    (["--steps", "many"], "invalid int value"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
    (["--resume", "/no/such/run"], "not found"),
])
def test_user_errors_are_one_line(tmp_path, corpus, cache, capsys, args, message):
    out = tmp_path / "runs"
    try:
        rc = main(_tiny(corpus, cache, out, "--steps", "2", "--name", "x", *args))
    except SystemExit as exit_:  # argparse's own errors (a value of the wrong type) exit
        rc = exit_.code
    assert message in _one_line_error(capsys, rc)
    assert not (out / "x").exists()  # nothing half-made


def test_empty_corpus(tmp_path, cache, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = main(_tiny(empty, tmp_path / "c", tmp_path / "runs", "--steps", "1", "--name", "x"))
    assert "empty" in _one_line_error(capsys, rc)
    assert not (tmp_path / "runs").exists()


def test_incompatible_resume_and_taken_name(finished_run, corpus, cache, capsys):
    rc = main(_tiny(corpus, cache, finished_run.parent, "--resume", str(finished_run), "--context-len", "64",
                    "--tokens-per-batch", "128"))
    line = _one_line_error(capsys, rc)
    assert "cannot resume" in line and "context_len=64" in line
    rc = main(_tiny(corpus, cache, finished_run.parent, "--steps", "1", "--name", finished_run.name))
    assert "already holds a run" in _one_line_error(capsys, rc)


def test_data_command(tmp_path, corpus, capsys):
    rc = main(["data", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "c"), "--splits", "train,validation", "--quiet"])
    assert rc == 0
    assert str(tmp_path / "c") in capsys.readouterr().out
    assert (tmp_path / "c" / "train.bin").is_file() and not (tmp_path / "c" / "test.bin").exists()
    rc = main(["data", "--corpus", str(tmp_path / "missing")])
    assert "corpus not found" in _one_line_error(capsys, rc)
    rc = main(["data", "--corpus", str(corpus), "--splits", "train,dev", "--cache-dir", str(tmp_path / "c")])
    assert "unknown split" in _one_line_error(capsys, rc)


def test_no_traceback_in_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "lintime", "train", "--preset", "no-such-model", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_every_train_flag_is_declared_once():
    """The train command's flags come from TrainConfig's fields (type, default and help declared there once) and
    the command's own few (run folder, threads, --task mqar's): nothing is declared twice."""
    import dataclasses

    from lintime.cli import _arg_help
    from lintime.cli.train import _OWN

    fields = dataclasses.fields(TrainConfig)
    assert all(f.metadata.get("help") for f in fields)
    flags = [f.metadata.get("flag") or f.name for f in fields]
    params = [p for p in inspect.signature(train_command).parameters if not p.startswith("_")]
    assert params == flags + list(_OWN) and not set(flags) & set(_OWN)
    helps = _arg_help(train_command.__doc__)
    for f, flag in zip(fields, flags):
        assert helps[flag] == f.metadata["help"], flag
