"""Corpus listing, the split rule, skipping of unreadable files, JSONL / parquet, corpus errors."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from lintime.data import SPLITS, DataError, MissingDependencyError, SkipStats, open_corpus, split_of, stdlib_root


def test_split_rule_is_the_documented_formula():
    for key in ["json/decoder.py", "a.txt", "data.jsonl#17", "ünï/cödé.py"]:
        u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64
        want = "test" if u < 0.1 else "validation" if u < 0.3 else "train"
        assert split_of(key, val_fraction=0.2, test_fraction=0.1) == want


def test_split_fractions_roughly_hold():
    counts = Counter(split_of(f"doc{i}.txt", 0.1, 0.05) for i in range(20000))
    # binomial sd at 20000 keys: 42 (p=0.1), 31 (p=0.05); the bounds are 6 sd (and the hash is fixed)
    assert abs(counts["validation"] - 2000) < 260 and abs(counts["test"] - 1000) < 190


def test_same_relative_path_same_split_under_any_root(tmp_path: Path, make_corpus):
    a, b = tmp_path / "machine_a" / "deep" / "root", tmp_path / "b"
    make_corpus(a, n_files=60, seed=1)
    make_corpus(b, n_files=60, seed=2)  # same paths, different contents
    ca, cb = open_corpus(a, val_fraction=0.2, test_fraction=0.2), open_corpus(b, val_fraction=0.2, test_fraction=0.2)
    keys_a = {s.key: ca.split_of(s.key) for s in ca.sources}
    keys_b = {s.key: cb.split_of(s.key) for s in cb.sources}
    assert keys_a == keys_b
    assert all(not k.startswith("/") and "\\" not in k for k in keys_a)
    assert set(keys_a.values()) == set(SPLITS)


def test_splits_are_disjoint_and_cover_the_corpus(corpus_dir: Path):
    corpus = open_corpus(corpus_dir, val_fraction=0.2, test_fraction=0.2)
    per_split = {s: [d.key for d in corpus.documents(s)] for s in SPLITS}
    all_keys = [k for keys in per_split.values() for k in keys]
    assert len(all_keys) == len(set(all_keys)) == len(corpus.sources)
    for s in SPLITS:
        assert per_split[s] == sorted(per_split[s])  # deterministic order
        assert per_split[s] == [d.key for d in corpus.documents(s)]  # and repeatable


def test_stdlib_corpus_is_relative_and_skips_site_packages():
    corpus = open_corpus("stdlib")
    assert corpus.root == stdlib_root()
    keys = [s.key for s in corpus.sources]
    assert len(keys) > 200 and all(k.endswith(".py") for k in keys)
    assert not any(part in ("site-packages", "dist-packages") for k in keys for part in k.split("/"))
    assert "json/decoder.py" in keys and not any(k.startswith("/") for k in keys)
    splits = Counter(corpus.split_of(k) for k in keys)
    assert all(splits[s] > 0 for s in SPLITS)


def test_unreadable_binary_and_empty_files_are_skipped_and_counted(tmp_path: Path):
    root = tmp_path / "c"
    root.mkdir()
    (root / "good.txt").write_text("hello")
    (root / "binary.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    (root / "empty.txt").write_text("")
    (root / ".hidden").write_text("not listed")
    corpus = open_corpus(root, val_fraction=0.0, test_fraction=0.0)
    stats = SkipStats()
    docs = list(corpus.documents("train", stats))
    assert [d.key for d in docs] == ["good.txt"]
    assert (stats.unreadable, stats.empty) == (2, 1)


def test_text_is_read_exactly(tmp_path: Path):
    root = tmp_path / "c"
    root.mkdir()
    raw = "line one\r\nline two\n\ttab é 😀 <eos>".encode("utf-8")
    (root / "a.txt").write_bytes(raw)
    (doc,) = open_corpus(root, val_fraction=0.0, test_fraction=0.0).documents("train")
    assert doc.text.encode("utf-8") == raw


def test_jsonl_text_field_and_bad_lines(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"body": f"doc {i}", "id": i}) for i in range(50)]
    lines[3] = "{not json"
    lines[4] = json.dumps({"other": "x"})
    lines[5] = ""
    path.write_text("\n".join(lines) + "\n")
    corpus = open_corpus(path, text_field="body", val_fraction=0.2, test_fraction=0.2)
    stats = {s: SkipStats() for s in SPLITS}
    docs = {s: list(corpus.documents(s, stats[s])) for s in SPLITS}
    keys = [d.key for s in SPLITS for d in docs[s]]
    assert len(keys) == len(set(keys)) == 47
    for s in SPLITS:
        assert all(split_of(d.key, 0.2, 0.2) == s and d.key.startswith("data.jsonl#") for d in docs[s])
    assert sum(st.unreadable for st in stats.values()) == 1
    assert sum(st.missing_field for st in stats.values()) == 1
    by_key = {d.key: d.text for s in SPLITS for d in docs[s]}
    assert by_key["data.jsonl#1"] == "doc 0" and by_key["data.jsonl#50"] == "doc 49"


def test_parquet_corpus(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(30)] + [None], "n": list(range(31))}), path)
    corpus = open_corpus(path, val_fraction=0.3, test_fraction=0.0)
    docs = [d for s in SPLITS for d in corpus.documents(s)]
    assert sorted(d.text for d in docs) == sorted(f"row {i}" for i in range(30))
    with pytest.raises(DataError, match="no column 'body'"):
        list(open_corpus(path, text_field="body").documents("train"))


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path: Path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    corpus = open_corpus(tmp_path / "t.parquet", val_fraction=0.0, test_fraction=0.0)
    with pytest.raises(MissingDependencyError, match="pyarrow") as err:
        list(corpus.documents("train"))
    assert isinstance(err.value, DataError) and isinstance(err.value, ImportError)


def test_glob_corpus_root_and_keys(tmp_path: Path, make_corpus):
    root = tmp_path / "g"
    make_corpus(root, n_files=12)
    (root / "pkg1" / "notes.md").write_text("markdown")
    corpus = open_corpus(str(root / "pkg*" / "**" / "*.txt"))
    assert corpus.root == root.absolute()
    assert {s.key for s in corpus.sources} == {p.relative_to(root).as_posix() for p in root.glob("pkg*/**/*.txt")}


def test_missing_and_empty_corpus_raise_data_error(tmp_path: Path):
    with pytest.raises(DataError, match="not found"):
        open_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty"):
        open_corpus(tmp_path / "empty")
    with pytest.raises(DataError, match="empty"):
        open_corpus(str(tmp_path / "empty" / "*.txt"))
