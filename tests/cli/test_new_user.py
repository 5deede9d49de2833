"""What a new user trips on (issue 29): one test per row of its table, each reproducing what the
user did.  Tiny runs (transformer-pp-tiny / gla-tiny, context 32, a few steps) in tmp folders."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lintime.cli import main
from lintime.training import TrainConfig
from lintime.training import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _write_corpus(root: Path, n_files: int = 80, salt: int = 0) -> Path:
    for i in range(n_files):
        body = "".join(f"def f{j}_{i}(x):\n    return x * {j + salt} + {i % 7}\n\n" for j in range(1 + i % 4))
        path = root / f"m{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


def _tiny(corpus, cache, out, *extra, preset="transformer-pp-tiny"):
    return ["train", "--preset", preset, "--corpus", str(corpus), "--cache-dir", str(cache), "--context-len", "32",
            "--tokens-per-batch", "128", "--eval-tokens", "256", "--sample-tokens", "8", "--no-plots", "--out",
            str(out), "--no-progress", *extra]


def _one_line_error(capsys, rc, code=2) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code, err
    assert len(err) == 1 and err[0].startswith("lintime"), err
    return err[0]


@pytest.fixture(scope="module")
def gla_run(tmp_path_factory, corpus) -> Path:
    """A finished gla-tiny run with seed 1, two checkpoints (steps 1 and 2)."""
    out = tmp_path_factory.mktemp("runs")
    assert main(_tiny(corpus, out / "cache", out, "--steps", "2", "--save-every", "1", "--keep", "0", "--seed", "1",
                      "--name", "gla", preset="gla-tiny")) == 0
    return out / "gla"


# --- row 1: `lintime train --corpus input.txt` (one text file) ------------------------------------

def test_one_text_file_trains(tmp_path, capsys):
    text = "".join(f"x{i} = {i} * 2\n" for i in range(3000))
    (tmp_path / "input.txt").write_text(text)
    assert main(_tiny(tmp_path / "input.txt", tmp_path / "c", tmp_path / "runs", "--steps", "2", "--name", "r")) == 0
    manifest = json.loads((tmp_path / "c" / "validation.json").read_text())
    assert manifest["identity"]["split_rule"]["rule"] == "position" and manifest["n_docs"] == 1


def test_a_file_too_short_to_split_names_only_flags_the_command_accepts(tmp_path, capsys):
    (tmp_path / "input.txt").write_text("abcde")  # the validation piece is empty
    rc = main(_tiny(tmp_path / "input.txt", tmp_path / "c", tmp_path / "runs", "--steps", "1"))
    line = _one_line_error(capsys, rc)
    assert "has no documents" in line and "--val-fraction" not in line
    rc = main(["data", "--corpus", str(tmp_path / "input.txt"), "--cache-dir", str(tmp_path / "c2"), "--quiet"])
    assert "--val-fraction" in _one_line_error(capsys, rc)  # `lintime data` accepts it


# --- row 2: `--resume RUN --preset flash-tiny` and other flags equal to their defaults -----------

@pytest.mark.parametrize("flag", [["--preset", "flash-tiny"], ["--context-len", "256", "--tokens-per-batch", "4096"],
                                  ["--recipe", "flash"], ["--seed", "0"]])
def test_resume_refuses_a_given_flag_equal_to_its_default(gla_run, corpus, capsys, flag):
    rc = main(["train", "--resume", str(gla_run), "--no-progress", *flag])
    line = _one_line_error(capsys, rc)
    assert "cannot resume" in line and flag[0].lstrip("-").replace("-", "_") in line


def test_resume_accepts_the_changeable_flags_and_the_runs_own_values(gla_run, capsys):
    rc = main(["train", "--resume", str(gla_run), "--no-progress", "--steps", "3", "--seed", "1", "--preset", "gla-tiny",
               "--sample-tokens", "0", "--eval-every", "0"])
    assert rc == 0, capsys.readouterr().err
    assert ckpt.load_model(gla_run).step == 3


# --- row 3: --cache-dir "$(lintime data ...)" ----------------------------------------------------

def test_data_prints_only_the_cache_folder_on_stdout(tmp_path, corpus, capsys):
    assert main(["data", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "c")]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'c'}\n"
    assert "tokens" in captured.err


# --- row 4: filesystem faults --------------------------------------------------------------------

def test_out_under_a_regular_file_fails_before_any_work(tmp_path, corpus, capsys):
    (tmp_path / "file").write_text("x")
    rc = main(_tiny(corpus, tmp_path / "cache", tmp_path / "file" / "runs", "--steps", "1"))
    assert "is not a folder" in _one_line_error(capsys, rc)
    assert not (tmp_path / "cache").exists()  # checked before the data was prepared


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs /sys (unwritable even for root)")
def test_unwritable_out_and_cache_dir(tmp_path, corpus, capsys):
    rc = main(_tiny(corpus, tmp_path / "cache", "/sys/kernel/lintime-runs", "--steps", "1"))
    assert "cannot write --out /sys/kernel/lintime-runs" in _one_line_error(capsys, rc)
    rc = main(_tiny(corpus, "/sys/kernel/lintime-cache", tmp_path / "runs", "--steps", "1"))
    assert "cannot write --cache-dir" in _one_line_error(capsys, rc)
    assert not (tmp_path / "runs").exists()
    rc = main(["data", "--corpus", str(corpus), "--cache-dir", "/sys/kernel/lintime-cache"])
    assert "cannot write --cache-dir /sys/kernel/lintime-cache: Permission denied" in _one_line_error(capsys, rc)


def test_full_disk_while_saving_a_checkpoint(tmp_path, corpus, capsys, monkeypatch):
    """torch.save reports a full disk as RuntimeError('... unexpected pos ...'): one line, exit 2,
    no half-written step folder."""
    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=0))
    rc = main(_tiny(corpus, tmp_path / "cache", tmp_path / "runs", "--steps", "1", "--name", "r"))
    line = _one_line_error(capsys, rc)
    assert os.strerror(errno.ENOSPC) in line and str(tmp_path / "runs" / "r" / "checkpoints") in line
    assert [p.name for p in (tmp_path / "runs" / "r" / "checkpoints").iterdir()] == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and mount rights, else skipped): a disk that really fills up."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_really_full_disk(tmp_path, corpus, capsys, tiny_disk):
    """flash-tiny's checkpoint (weights + optimizer, ~7.5 MB) cannot fit on 2 MiB."""
    rc = main(_tiny(corpus, tmp_path / "cache", tiny_disk, "--steps", "1", "--name", "r", preset="flash-tiny"))
    line = _one_line_error(capsys, rc)
    assert os.strerror(errno.ENOSPC) in line and str(tiny_disk / "r" / "checkpoints") in line
    assert [p.name for p in (tiny_disk / "r" / "checkpoints").iterdir()] == []


def test_eval_json_to_an_unwritable_path_fails_before_evaluating(gla_run, tmp_path, capsys, monkeypatch):
    import lintime.evaluation

    monkeypatch.setattr(lintime.evaluation, "evaluate", lambda *a, **k: pytest.fail("evaluated first"))
    (tmp_path / "file").write_text("x")
    rc = main(["eval", str(gla_run), "--json", str(tmp_path / "file" / "out.json"), "--no-progress"])
    assert "cannot write --json" in _one_line_error(capsys, rc)


def test_train_piped_into_head(tmp_path, corpus):
    """A real pipe closed after the first line: no traceback, the run finishes and is saved."""
    args = _tiny(corpus, tmp_path / "cache", tmp_path / "runs", "--steps", "3", "--name", "r", "--eval-every", "1")
    proc = subprocess.Popen([sys.executable, "-m", "lintime", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    proc.stdout.readline()
    proc.stdout.close()  # `| head -1` leaves
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "Traceback" not in err, err
    assert ckpt.load_model(tmp_path / "runs" / "r").step == 3


def test_generate_piped_into_head(gla_run, tmp_path):
    for args in (["generate", str(gla_run), "--max-new-tokens", "100", "--temperature", "0"],):
        proc = subprocess.Popen([sys.executable, "-m", "lintime", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=ENV)
        proc.stdout.read(1)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
        assert "Traceback" not in err, err


# --- row 5: corrupted weights --------------------------------------------------------------------

def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupted_weights_are_refused_naming_the_intact_checkpoint(gla_run, tmp_path, capsys):
    run = _copy_run(gla_run, tmp_path / "run")
    newest = ckpt.resolve_checkpoint(run)
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 1000:header + 5000] = os.urandom(4000)  # 4,000 bytes, header intact
    weights.write_bytes(bytes(data))
    older = ckpt.list_checkpoints(run)[-2]
    for cmd in (["eval", str(run), "--context-lens", "16", "--no-progress"], ["generate", str(run), "--max-new-tokens", "4"]):
        line = _one_line_error(capsys, main(cmd))
        assert "corrupted" in line and f"newest intact checkpoint is {older}" in line
    # NaN with a matching checksum (e.g. saved that way): the finite check refuses it
    from safetensors.torch import load_file, save_file

    tensors = load_file(older / "model.safetensors")
    next(iter(tensors.values())).view(-1)[0] = float("nan")
    save_file(tensors, older / "model.safetensors", metadata={"format": "lintime"})
    (older / "checksums.json").unlink()
    line = _one_line_error(capsys, main(["generate", str(older), "--max-new-tokens", "4"]))
    assert "NaN or infinity" in line


# --- row 6: run folders never become dead ends ---------------------------------------------------

def _wait_for_rows(run: Path, n: int, proc, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = run / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    pytest.fail("the run did not start")


def test_a_signal_saves_a_checkpoint_and_the_run_resumes(tmp_path, corpus):
    """Ctrl-C (SIGINT) here; SIGTERM goes through the same handler (lintime/training/runguard.py ``StopSignals`` takes
    both, the exit status is 128 + the signal on both paths of lintime/cli/train.py) and is sent to a real
    ``lintime train --task mqar`` in tests/cli/test_mqar_cli.py."""
    sig = signal.SIGINT
    run = tmp_path / "runs" / "r"
    args = _tiny(corpus, tmp_path / "cache", tmp_path / "runs", "--steps", "100000", "--name", "r", "--save-every", "0")
    proc = subprocess.Popen([sys.executable, "-m", "lintime", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    _wait_for_rows(run, 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    out, err = out.decode(), err.decode()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and f"stopped by {signal.Signals(sig).name}" in err
    assert (out + err).count("stopped by") == 1, out + err  # one line, not one on stdout and one on stderr
    step = ckpt.load_model(run).step
    assert step >= 2 and ckpt.verify_checkpoint(ckpt.resolve_checkpoint(run)) is None
    assert main(["train", "--resume", str(run), "--steps", str(step + 1), "--no-progress", "--sample-tokens", "0"]) == 0
    assert ckpt.load_model(run).step == step + 1


def test_a_run_without_a_checkpoint_restarts_under_its_name(tmp_path, corpus, capsys):
    """`--lr 1e9` diverges before the first save: the folder is not a dead end."""
    args = _tiny(corpus, tmp_path / "cache", tmp_path / "runs", "--steps", "4", "--name", "r")
    line = _one_line_error(capsys, main([*args, "--lr", "1e9"]))
    assert "diverged" in line and "before any checkpoint" in line
    run = tmp_path / "runs" / "r"
    assert (run / "config.json").is_file() and not ckpt.list_checkpoints(run)
    assert main(["train", "--resume", str(run), "--no-progress", "--steps", "1"]) == 2  # same settings: diverges again
    capsys.readouterr()
    assert main([*args, "--lr", "3e-3"]) == 0  # the same --name starts it over
    assert "starting it over" in capsys.readouterr().out
    assert ckpt.load_model(run).step == 4
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 3e-3


def test_resume_of_a_run_without_a_checkpoint_starts_it_over(tmp_path, corpus, capsys):
    args = _tiny(corpus, tmp_path / "cache", tmp_path / "runs", "--steps", "2", "--name", "r")
    assert main(args) == 0
    run = tmp_path / "runs" / "r"
    import shutil

    shutil.rmtree(run / "checkpoints")  # as after a kill -9 before the first checkpoint
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "no checkpoint yet: starting the run over" in capsys.readouterr().out
    assert ckpt.load_model(run).step == 2


def test_a_diverged_run_keeps_its_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    from lintime.training import trainer

    real, calls = trainer.forward_backward, []

    def fb(*args, **kwargs):
        calls.append(1)
        loss, aux = real(*args, **kwargs)
        return (float("nan") if len(calls) == 5 else loss), aux

    monkeypatch.setattr(trainer, "forward_backward", fb)
    cfg = TrainConfig(preset="transformer-pp-tiny", corpus=str(corpus), cache_dir=str(tmp_path / "c"), context_len=32,
                      tokens_per_batch=128, steps=8, save_every=2, keep=0, eval_every=0, eval_tokens=256, plots=False,
                      sample_tokens=0, device="cpu")
    with pytest.raises(ValueError, match=r"diverged at step 5 .*last good checkpoint is .*step_00000004"):
        trainer.train(cfg, out=tmp_path / "runs", name="r", progress=False, echo=None)
    run = tmp_path / "runs" / "r"
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000002", "step_00000004"]
    assert ckpt.load_model(run).step == 4


def test_a_second_writer_is_refused(gla_run, tmp_path, capsys):
    run = _copy_run(gla_run, tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lintime.training.runguard import RunLock; "
                               f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, env=ENV)
    try:
        assert holder.stdout.readline().strip() == b"held"
        rc = main(["train", "--resume", str(run), "--steps", "3", "--no-progress"])
        assert f"in use by another lintime train (pid {holder.pid}" in _one_line_error(capsys, rc)
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-progress", "--sample-tokens", "0"]) == 0


# --- row 7: `lintime eval HF_EXPORT_FOLDER` ------------------------------------------------------

def test_eval_and_generate_take_an_exported_folder(gla_run, corpus, tmp_path, capsys):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    assert main(["export", str(gla_run), str(hf), "--no-remote-code"]) == 0
    capsys.readouterr()
    tables = []
    for src in (gla_run, hf):
        assert main(["eval", str(src), "--data", str(corpus), "--context-lens", "16", "--no-progress"]) == 0
        tables.append(capsys.readouterr().out.splitlines()[-1].split()[:4])  # context, bits/byte, bits/token, loss
    assert tables[0] == tables[1]
    texts = []
    for src in (gla_run, hf):
        assert main(["generate", str(src), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12",
                     "--no-stats"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    line = _one_line_error(capsys, main(["eval", str(hf), "--no-progress"]))
    assert "--data" in line  # an export has no training data to default to


# --- row 8: a preset trains with its family's recipe ---------------------------------------------

def test_presets_train_with_their_familys_recipe(gla_run):
    assert json.loads((gla_run / "config.json").read_text())["train"]["recipe"] == "gla"
    assert TrainConfig(preset="gla-small").resolved().lr == 3e-4  # the GLA seed's rate
    assert TrainConfig(preset="gla-tiny").resolved().lr == 3e-3  # a tiny model's
    assert TrainConfig(preset="vq-tiny").resolved().recipe == "vq"
    assert TrainConfig(preset="transformer-pp-tiny").resolved().recipe == "flash"
    assert TrainConfig(preset="gla-tiny", recipe="flash").resolved().recipe == "flash"


# --- row 9: fine-tuning with --init-from ---------------------------------------------------------

def test_init_from_starts_from_the_weights_with_new_data(gla_run, tmp_path, capsys):
    new = _write_corpus(tmp_path / "new", n_files=60, salt=5)
    args = ["train", "--init-from", str(gla_run), "--corpus", str(new), "--cache-dir", str(tmp_path / "c"),
            "--context-len", "32", "--tokens-per-batch", "128", "--steps", "1", "--lr", "1e-12", "--weight-decay", "0",
            "--eval-every", "0", "--eval-tokens", "256", "--sample-tokens", "0", "--no-plots", "--no-progress",
            "--out", str(tmp_path / "runs"), "--name", "ft"]
    assert main(args) == 0  # no --preset: the checkpoint's (gla-tiny)
    assert "initialised from" in capsys.readouterr().out
    a, b = ckpt.load_model(gla_run).model.state_dict(), ckpt.load_model(tmp_path / "runs" / "ft").model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    cfg = json.loads((tmp_path / "runs" / "ft" / "config.json").read_text())["train"]
    assert cfg["init_from"] == str(gla_run) and cfg["corpus"] == str(new) and cfg["preset"] == "gla-tiny"
    line = _one_line_error(capsys, main([*args[:-1], "ft2", "--preset", "flash-tiny"]))
    assert "architecture cannot change" in line
    line = _one_line_error(capsys, main([*args[:-1], "ft3", "--tokenizer", "bpe:300"]))
    assert "vocabulary" in line


# --- row 10: the default first run ---------------------------------------------------------------

def test_the_readme_shows_the_default_run():
    """The README's first-run output is of the current default (preset, steps, batch, recipe)."""
    cfg = TrainConfig().resolved()
    block = (REPO / "README.md").read_text().split("## Train", 1)[1].split("```", 2)[1]
    assert f"lintime train: {cfg.preset} (" in block
    assert f"{cfg.steps} steps x {cfg.rows_per_batch} rows x {cfg.context_len} tokens; recipe {cfg.recipe}: lr {cfg.lr:g}" in block


# --- row 11: progress without a terminal, --threads, plots ---------------------------------------

def test_progress_lines_without_a_terminal_and_threads(gla_run, capsys, monkeypatch):
    import lintime.cli.eval as eval_cli

    monkeypatch.setattr(eval_cli, "PROGRESS_EVERY_S", 0.0)
    torch.set_num_threads(2)
    assert main(["eval", str(gla_run), "--context-lens", "16,32"]) == 0  # capsys: stderr is not a TTY
    err = capsys.readouterr().err
    assert "lintime eval: context 16:" in err and "lintime eval: context 32:" in err
    assert torch.get_num_threads() == 1  # auto: one thread for a tiny model
    assert main(["generate", str(gla_run), "--max-new-tokens", "2", "--threads", "2", "--no-stats"]) == 0
    assert torch.get_num_threads() == 2


def test_plots_are_in_bits_per_byte_with_the_learning_rate(gla_run, monkeypatch):
    import matplotlib.figure

    from lintime.training.metrics import plot_metrics

    labels, real = [], matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kwargs):
        labels.append([ax.get_ylabel() for ax in fig.axes])
        return real(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_metrics(gla_run, bits_per_byte=True)
    assert labels == [["bits per byte", "learning rate"]] * 2


# --- row 12: the test extra stays lean -----------------------------------------------------------

def test_the_test_extra_does_not_pull_lm_eval_and_ci_still_runs_it():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def closure(name: str) -> list[str]:
        out = []
        for dep in extras[name]:
            if dep.startswith("lintime["):
                for sub in dep[len("lintime["):-1].split(","):
                    out += closure(sub)
            else:
                out.append(dep)
        return out

    assert not any(d.startswith("lm-eval") for d in closure("test"))
    assert any(d.startswith("lm-eval") for d in closure("eval"))
    readme_cmd = next(line for line in (REPO / "README.md").read_text().splitlines() if "pytest" in line)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    # the README's test command runs first in its own environment; the eval extra is installed after it
    assert readme_cmd in ci and any('".[eval]"' in line for line in ci[ci.index(readme_cmd):])


def test_lm_eval_test_skips_cleanly_without_lm_eval(tmp_path):
    (tmp_path / "lm_eval").mkdir()
    (tmp_path / "lm_eval" / "__init__.py").write_text("raise ImportError('lm_eval is not installed')\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path) + os.pathsep + ENV["PYTHONPATH"]}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           str(REPO / "tests" / "hf" / "test_lm_eval.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr
