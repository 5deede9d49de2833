"""A single text file is a corpus (nanoGPT's ``input.txt``): it is cut by position into train /
validation / test (docs/data.md), cached and packed like any corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from lintime.data import EmptySplitError, open_corpus, prepare
from lintime.data.corpus import position_cuts


def _lines(n: int) -> str:
    return "".join(f"x{i} = {i} * 2  # line {i}\n" for i in range(n))


def test_position_cuts_are_the_documented_rule():
    text = _lines(200)
    cuts = position_cuts(text, val_fraction=0.1, test_fraction=0.05)
    a, b = cuts["train"][1], cuts["validation"][1]
    assert cuts == {"train": (0, a), "validation": (a, b), "test": (b, len(text))}
    # each cut is the first line start at or after floor(n * fraction)
    for cut, nominal in ((a, int(len(text) * 0.85)), (b, int(len(text) * 0.95))):
        assert cut >= nominal and text[cut - 1] == "\n" and "\n" not in text[nominal:cut - 1]
    # no newline after the nominal cut: the cut stays where it is
    assert position_cuts("a" * 100, 0.1, 0.1) == {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}


def test_one_text_file_gives_three_splits_in_file_order(tmp_path: Path):
    text = _lines(400)
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    corpus = open_corpus(path)
    assert corpus.by_position and corpus.split_rule()["rule"] == "position"
    got = {s: [d.text for d in corpus.documents(s)] for s in ("train", "validation", "test")}
    assert all(len(docs) == 1 for docs in got.values())
    assert got["train"][0] + got["validation"][0] + got["test"][0] == text  # nothing lost, nothing repeated
    assert got["train"][0].startswith("x0 = 0") and got["test"][0].endswith("# line 399\n")
    splits = prepare(path, "byte", tmp_path / "cache", quiet=True)
    assert {s: ds.n_docs for s, ds in splits.items()} == {"train": 1, "validation": 1, "test": 1}
    assert sum(ds.n_bytes for ds in splits.values()) == len(text.encode())
    assert bytes(splits["validation"][0]).decode() == got["validation"][0]


def test_a_folder_of_one_file_still_uses_the_hash_rule(tmp_path: Path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(_lines(10))
    assert not open_corpus(tmp_path / "d").by_position


def test_too_short_a_file_names_no_flag_of_another_command(tmp_path: Path):
    path = tmp_path / "tiny.txt"
    path.write_text("one line only")  # val_fraction 0: the validation piece is empty
    with pytest.raises(EmptySplitError) as err:
        prepare(path, "byte", tmp_path / "cache", val_fraction=0.0, quiet=True)
    assert "has no documents" in str(err.value) and "--" not in str(err.value)
