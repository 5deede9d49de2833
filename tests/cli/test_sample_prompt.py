"""The final sample's prompt and the validation line of `lintime train`, for a corpus that is not code."""

from __future__ import annotations

import re

import pytest

from lintime.cli import main

OPENING = "Once upon a time there was"


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    root = tmp_path_factory.mktemp("prose")
    for i in range(60):
        body = f"{OPENING} a tale number {i}.\nIt went on for {i % 5 + 2} lines of plain words.\n" * 3
        (root / f"story{i:02d}.txt").write_text(body, encoding="utf-8")
    return root


def test_the_default_prompt_comes_from_the_corpus(prose, tmp_path, capsys):
    """Without --prompt the sample starts from the first words of a validation document, not from code."""
    args = ["train", "--preset", "transformer-pp-tiny", "--corpus", str(prose), "--cache-dir", str(tmp_path / "c"),
            "--context-len", "32", "--tokens-per-batch", "128", "--steps", "2", "--eval-tokens", "256",
            "--sample-tokens", "8", "--no-plots", "--no-progress", "--out", str(tmp_path), "--name", "r"]
    assert main(args) == 0
    out = capsys.readouterr().out
    sample = (tmp_path / "r" / "sample.txt").read_text()
    assert sample.startswith("Once upon a ") and not sample.startswith("def ")
    prompt = re.search(r"sample \(prompt '([^']*)'", out).group(1)
    assert OPENING.startswith(prompt.rstrip()) and len(prompt) >= 8
    # the validation line says which tokens it covers (the first of the split, not the whole split)
    line = next(x for x in out.splitlines() if x.startswith("validation:"))
    n = int(re.search(r"first ([\d,]+) tokens", line).group(1).replace(",", ""))
    assert 0 < n <= 256


def test_a_given_prompt_is_used(prose, tmp_path):
    args = ["train", "--preset", "transformer-pp-tiny", "--corpus", str(prose), "--cache-dir", str(tmp_path / "c"),
            "--context-len", "32", "--tokens-per-batch", "128", "--steps", "1", "--eval-tokens", "128",
            "--sample-tokens", "4", "--no-plots", "--no-progress", "--out", str(tmp_path), "--name", "r",
            "--prompt", "Dear "]
    assert main(args) == 0
    assert (tmp_path / "r" / "sample.txt").read_text().startswith("Dear ")
