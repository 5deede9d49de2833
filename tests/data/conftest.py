"""Fixtures for the data tests: small corpora written to tmp folders, and prepared byte datasets."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lintime.data import prepare

ALPHABET = "abcdefghijklmnopqrstuvwxyz     \n\t.,:;()[]{}=+-*/_'\"0123456789é€😀"


def random_text(rng: random.Random, n_chars: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n_chars))


def write_corpus(root: Path, n_files: int = 40, seed: int = 0, max_chars: int = 300) -> dict[str, str]:
    """``n_files`` UTF-8 text files under ``root`` (some in sub-folders), lengths 1..max_chars."""
    rng = random.Random(seed)
    files = {}
    for i in range(n_files):
        rel = f"pkg{i % 3}/sub{i % 2}/file{i:03d}.txt" if i % 4 else f"file{i:03d}.txt"
        text = random_text(rng, rng.randint(1, max_chars))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        files[rel] = text
    return files


@pytest.fixture
def make_corpus():
    """The :func:`write_corpus` helper, as a fixture (test modules do not import conftest)."""
    return write_corpus


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write_corpus(root)
    return root


@pytest.fixture
def byte_splits(tmp_path: Path, corpus_dir: Path):
    """The corpus prepared with the byte tokenizer; validation/test fractions large enough to be non-empty."""
    return prepare(corpus_dir, "byte", tmp_path / "cache", val_fraction=0.2, test_fraction=0.2, quiet=True)
