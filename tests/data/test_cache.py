"""The token cache: contents, reuse vs rebuild, atomic writes, consistency checks, errors, progress."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from lintime.data import (
    SPLITS,
    ByteTokenizer,
    DataError,
    TokenDataset,
    atomic_write,
    open_corpus,
    open_prepared,
    prepare,
)
from lintime.data.cache import HEADER_SIZE
from lintime.data.progress import Progress

FRACTIONS = dict(val_fraction=0.2, test_fraction=0.2)


def _snapshot(cache: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(cache.iterdir())}


def _no_temp_files(cache: Path) -> bool:
    return not [p for p in cache.rglob("*") if p.name.startswith(".")]


def test_cache_holds_every_document_exactly(tmp_path: Path, corpus_dir: Path, byte_splits):
    corpus = open_corpus(corpus_dir, **FRACTIONS)
    for split in SPLITS:
        ds = byte_splits[split]
        docs = list(corpus.documents(split))
        assert len(ds) == len(docs) > 0
        assert ds.tokens.dtype == np.uint8
        for i, doc in enumerate(docs):
            assert bytes(ds[i]) == doc.text.encode("utf-8")
        man = json.loads((tmp_path / "cache" / f"{split}.json").read_text())
        assert man["n_docs"] == len(docs) and man["n_tokens"] == ds.n_tokens == man["n_bytes"]
        assert man["identity"]["tokenizer"] == "byte" and man["identity"]["split"] == split
        assert man["tokenizer"]["vocab_size"] == 260 and man["tokenizer"]["bits_per_byte"] is True
        size = (tmp_path / "cache" / f"{split}.bin").stat().st_size
        assert size == HEADER_SIZE + (ds.n_tokens + 7) // 8 * 8 + 8 * (len(docs) + 1)


def test_cache_is_reused_when_nothing_changed(tmp_path: Path, corpus_dir: Path, byte_splits):
    cache = tmp_path / "cache"
    before = _snapshot(cache)
    again = prepare(corpus_dir, "byte", cache, quiet=True, **FRACTIONS)
    assert all(ds.reused for ds in again.values())
    assert _snapshot(cache) == before


def test_changed_file_rebuilds_only_its_split(tmp_path: Path, corpus_dir: Path, byte_splits):
    cache = tmp_path / "cache"
    corpus = open_corpus(corpus_dir, **FRACTIONS)
    victim = next(s for s in corpus.sources if corpus.split_of(s.key) == "validation")
    victim.path.write_text("changed text", encoding="utf-8")
    os.utime(victim.path, ns=(victim.mtime_ns + 10**9, victim.mtime_ns + 10**9))
    again = prepare(corpus_dir, "byte", cache, quiet=True, **FRACTIONS)
    assert not again["validation"].reused and again["train"].reused and again["test"].reused
    texts = [bytes(again["validation"][i]) for i in range(len(again["validation"]))]
    assert b"changed text" in texts


def test_added_file_tokenizer_and_rule_changes_rebuild(tmp_path: Path, corpus_dir: Path, byte_splits):
    cache = tmp_path / "cache"
    (corpus_dir / "new_file.txt").write_text("new")  # "new_file.txt" hashes into train
    again = prepare(corpus_dir, "byte", cache, quiet=True, **FRACTIONS)
    assert not again["train"].reused and again["train"].n_docs == byte_splits["train"].n_docs + 1
    other_rule = prepare(corpus_dir, "byte", cache, quiet=True, val_fraction=0.3, test_fraction=0.2)
    assert not any(ds.reused for ds in other_rule.values())
    forced = prepare(corpus_dir, "byte", cache, quiet=True, rebuild=True, val_fraction=0.3, test_fraction=0.2)
    assert not any(ds.reused for ds in forced.values())


def test_bpe_cache_uses_uint16_and_rebuilds_on_tokenizer_change(tmp_path: Path, corpus_dir: Path, byte_splits):
    pytest.importorskip("tokenizers")
    bpe = prepare(corpus_dir, "bpe:300", tmp_path / "cache", quiet=True, **FRACTIONS)
    assert not any(ds.reused for ds in bpe.values())
    tok = bpe["train"].tokenizer
    assert bpe["train"].tokens.dtype == np.uint16
    corpus = open_corpus(corpus_dir, **FRACTIONS)
    docs = list(corpus.documents("train"))
    assert all(tok.decode(bpe["train"][i]) == d.text for i, d in enumerate(docs))
    assert bpe["train"].n_bytes == byte_splits["train"].n_tokens
    assert all(ds.reused for ds in prepare(corpus_dir, "bpe:300", tmp_path / "cache", quiet=True, **FRACTIONS).values())


def test_failure_while_writing_leaves_old_cache_and_no_temp_files(tmp_path: Path, corpus_dir: Path, byte_splits):
    cache = tmp_path / "cache"
    before = _snapshot(cache)

    class Exploding(ByteTokenizer):
        calls = 0

        @property
        def name(self) -> str:
            return "exploding-byte"  # a different tokenizer: every split must be rebuilt

        def encode_batch(self, texts):
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="disk full"):
        prepare(corpus_dir, Exploding(), cache, quiet=True, **FRACTIONS)
    assert _snapshot(cache) == before and _no_temp_files(cache)
    assert all(ds.reused for ds in prepare(corpus_dir, "byte", cache, quiet=True, **FRACTIONS).values())


def test_atomic_write_never_leaves_partial_files(tmp_path: Path):
    target = tmp_path / "out.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with atomic_write(target) as f:
        f.write(b"whole")
    with pytest.raises(ValueError):
        with atomic_write(target) as f:
            f.write(b"replacement, half")
            raise ValueError
    assert target.read_bytes() == b"whole" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_truncated_or_mismatched_files_are_rebuilt(tmp_path: Path, corpus_dir: Path, byte_splits):
    cache = tmp_path / "cache"
    with open(cache / "train.bin", "r+b") as f:  # crash-like damage: file cut short
        f.truncate(HEADER_SIZE + 3)
    with pytest.raises(DataError, match="incomplete"):
        open_prepared(cache, "train")
    # a .bin from another build next to this manifest (as after a crash between the two renames)
    (cache / "validation.bin").write_bytes((cache / "test.bin").read_bytes())
    # same sizes and counts, but written for another identity: only the header digest tells
    with open(cache / "test.bin", "r+b") as f:
        f.seek(HEADER_SIZE - 32)
        f.write(bytes(32))
    again = prepare(corpus_dir, "byte", cache, quiet=True, **FRACTIONS)
    assert not any(ds.reused for ds in again.values())
    assert again["train"].n_tokens == byte_splits["train"].n_tokens


def test_open_prepared_without_the_corpus(tmp_path: Path, byte_splits):
    ds = open_prepared(tmp_path / "cache", "validation", ByteTokenizer())
    assert isinstance(ds, TokenDataset) and ds.n_tokens == byte_splits["validation"].n_tokens
    with pytest.raises(DataError, match="no prepared split"):
        open_prepared(tmp_path / "elsewhere", "train")


def test_empty_split_is_a_data_error_and_writes_nothing(tmp_path: Path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "only.txt").write_text("one document")
    with pytest.raises(DataError, match="'validation' .* no documents"):
        prepare(tmp_path / "c", "byte", tmp_path / "cache", val_fraction=0.0, test_fraction=0.0, quiet=True)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["train.bin", "train.json"]
    ok = prepare(tmp_path / "c", "byte", tmp_path / "cache", splits=("train",), val_fraction=0.0, test_fraction=0.0, quiet=True)
    assert ok["train"].reused and len(ok["train"]) == 1


def test_all_binary_corpus_error_mentions_skips(tmp_path: Path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.bin").write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match="1 unreadable"):
        prepare(tmp_path / "c", "byte", tmp_path / "cache", splits=("train",), val_fraction=0, test_fraction=0, quiet=True)


def test_stdlib_default_corpus_prepares(tmp_path: Path):
    # only the validation split (about 1 MB), to keep the test fast
    ds = prepare("stdlib", "byte", tmp_path / "cache", splits=("validation",), quiet=True)["validation"]
    assert len(ds) > 10 and ds.n_tokens > 100_000 and ds.tokens.max() < 256


def test_progress_without_tqdm_writes_a_plain_bar(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    out = io.StringIO()
    with Progress(2_000_000, "train", stream=out) as bar:
        bar.update(1_000_000)
        bar.update(1_000_000)
    assert "train 100% 2.0/2.0 MB" in out.getvalue() and out.getvalue().endswith("\n")
    quiet = io.StringIO()
    with Progress(10, "x", quiet=True, stream=quiet) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


def test_prepare_prints_a_summary_unless_quiet(tmp_path: Path, corpus_dir: Path, capsys):
    prepare(corpus_dir, "byte", tmp_path / "cache", quiet=True, **FRACTIONS)
    assert capsys.readouterr().err == ""
    prepare(corpus_dir, "byte", tmp_path / "cache", **FRACTIONS)
    assert "reusing" in capsys.readouterr().err
