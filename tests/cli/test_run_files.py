"""What a new user met with the files of a run (issue 40): corrupted checkpoints and ``--keep``,
the permissions of what the commands write, and a corpus that is not UTF-8 text.  Tiny runs
(transformer-pp-tiny, context 32, a few steps) in tmp folders."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from lintime.cli import main
from lintime.training import checkpoint as ckpt


def _write_corpus(root: Path, n_files: int = 80) -> Path:
    for i in range(n_files):
        body = "".join(f"def f{j}_{i}(x):\n    return x * {j} + {i % 7}\n\n" for j in range(1 + i % 4))
        path = root / f"m{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))


def _tiny(corpus, cache, out, *extra):
    return ["train", "--preset", "transformer-pp-tiny", "--corpus", str(corpus), "--cache-dir", str(cache),
            "--context-len", "32", "--tokens-per-batch", "128", "--eval-tokens", "256", "--sample-tokens", "8",
            "--no-plots", "--out", str(out), "--no-progress", *extra]


def _one_line_error(capsys, rc, code=2) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code, err
    assert len(err) == 1 and err[0].startswith("lintime"), err
    return err[0]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, corpus) -> Path:
    """A finished run with a checkpoint at each of steps 1, 2 and 3 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("runs")
    assert main(_tiny(corpus, out / "cache", out, "--steps", "3", "--save-every", "1", "--keep", "0",
                      "--name", "r")) == 0
    return out / "r"


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _scribble(path: Path) -> None:
    """Overwrite bytes in the middle of the file (same size)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(255 - b for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def _names(run: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(run)]


def _all_intact(run: Path) -> bool:
    return all(ckpt.verify_checkpoint(p) is None for p in ckpt.list_checkpoints(run))


# --- 1. corrupted checkpoints never outrank intact ones -------------------------------------------

def test_resume_from_an_older_step_drops_the_corrupted_later_ones(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path / "r")
    _truncate(_step(run, 2) / "model.safetensors")
    _scribble(_step(run, 3) / "trainer_state.pt")
    assert ckpt.verify_checkpoint(_step(run, 2)) and ckpt.verify_checkpoint(_step(run, 3))
    # the run's "latest" is corrupted: resolving the run gives the intact step 1, never a corrupted one
    assert ckpt.resolve_checkpoint(run) == _step(run, 1)

    rc = main(["train", "--resume", str(_step(run, 1)), "--steps", "2", "--save-every", "1", "--keep", "2",
               "--no-progress", "--sample-tokens", "0"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    said = captured.out + captured.err
    assert "abandoned" in said and "step_00000002 (corrupted)" in said and "step_00000003 (corrupted)" in said
    # --keep 2 kept the two newest intact checkpoints: step 1 and the new step 2; step 3 is gone
    assert _names(run) == ["step_00000001", "step_00000002"] and _all_intact(run)
    assert not _step(run, 3).exists() and not (run / "checkpoints" / "abandoned").exists()
    assert ckpt.resolve_checkpoint(run) == _step(run, 2) and ckpt.load_model(run).step == 2


def test_keep_counts_only_intact_checkpoints(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path / "r")
    _truncate(_step(run, 2) / "model.safetensors")  # an older checkpoint rots on disk
    rc = main(["train", "--resume", str(run), "--steps", "4", "--save-every", "1", "--keep", "3",
               "--no-progress", "--sample-tokens", "0"])
    assert rc == 0, capsys.readouterr().err
    # the three newest intact ones; the corrupted step 2 neither counts nor stays
    assert _names(run) == ["step_00000001", "step_00000003", "step_00000004"] and _all_intact(run)


def test_resume_of_a_run_whose_latest_is_corrupted_goes_on_from_the_newest_intact_one(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path / "r")
    _scribble(_step(run, 3) / "model.safetensors")
    # loading the run for eval refuses the corrupted latest, naming the intact one (no silent older model)
    line = _one_line_error(capsys, main(["generate", str(run), "--max-new-tokens", "2"]))
    assert "corrupted" in line and str(_step(run, 2)) in line
    rc = main(["train", "--resume", str(run), "--steps", "3", "--keep", "0", "--no-progress", "--sample-tokens", "0"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "step_00000003 (corrupted)" in captured.out + captured.err
    assert _names(run) == ["step_00000001", "step_00000002", "step_00000003"] and _all_intact(run)
    assert ckpt.load_model(run).step == 3


def test_intact_later_checkpoints_are_set_aside_not_deleted(three_steps, tmp_path, capsys):
    run = _copy(three_steps, tmp_path / "r")
    rc = main(["train", "--resume", str(_step(run, 1)), "--steps", "2", "--keep", "0", "--no-progress",
               "--sample-tokens", "0"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "abandoned" in captured.out + captured.err
    assert _names(run) == ["step_00000001", "step_00000002"] and ckpt.resolve_checkpoint(run) == _step(run, 2)
    aside = run / "checkpoints" / "abandoned"
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000002", "step_00000003"]
    assert ckpt.load_model(aside / "step_00000003").step == 3  # still loadable where it was set aside


# --- 2. files and folders get ordinary permissions ------------------------------------------------

@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_run_and_export_folders_honour_the_umask(tmp_path, corpus, capsys, mask):
    old = os.umask(mask)
    try:
        runs, cache, hf = tmp_path / "runs", tmp_path / "cache", tmp_path / "hf"
        assert main(_tiny(corpus, cache, runs, "--steps", "2", "--save-every", "1", "--keep", "0", "--name", "r")) == 0
        assert main(["export", str(runs / "r"), str(hf)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    wrong = []
    for top in (runs, cache, hf):
        for path in [top, *top.rglob("*")]:
            want = (0o777 if path.is_dir() else 0o666) & ~mask
            if stat.S_IMODE(path.lstat().st_mode) != want:
                wrong.append(f"{oct(stat.S_IMODE(path.lstat().st_mode))} {path}")
    assert any((runs / "r" / "checkpoints").rglob("model.safetensors"))  # checkpoints were among them
    assert not wrong, wrong


# --- 3. a corpus that is not UTF-8 text -----------------------------------------------------------

def _random_bytes(path: Path) -> Path:
    path.write_bytes(os.urandom(20_000))
    return path


def _latin1(path: Path) -> Path:
    path.write_bytes("".join(f"caf\u00e9 na\u00efve {i}\n" for i in range(2000)).encode("latin-1"))
    return path


@pytest.mark.parametrize("make", [_random_bytes, _latin1], ids=["binary", "latin-1"])
def test_a_corpus_file_that_is_not_text_fails_in_one_line(tmp_path, capsys, make):
    path = make(tmp_path / ("some.bin" if make is _random_bytes else "input.txt"))
    line = _one_line_error(capsys, main(_tiny(path, tmp_path / "cache", tmp_path / "runs", "--steps", "1")))
    assert "not UTF-8 text" in line and str(path) in line
    assert not (tmp_path / "runs").exists()


def test_a_folder_without_any_text_says_so(tmp_path, corpus, capsys):
    folder = tmp_path / "c"
    folder.mkdir()
    _random_bytes(folder / "a.bin")
    _latin1(folder / "b.txt")
    line = _one_line_error(capsys, main(_tiny(folder, tmp_path / "cache", tmp_path / "runs", "--steps", "1")))
    assert "no text" in line and "not UTF-8 text" in line and "larger corpus" not in line
    # files that are not text among text files are skipped, as before
    mixed = _copy(corpus, tmp_path / "mixed")
    _random_bytes(mixed / "zz.bin")
    assert main(["data", "--corpus", str(mixed), "--cache-dir", str(tmp_path / "c2"), "--quiet"]) == 0
