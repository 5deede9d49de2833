"""Byte and BPE tokenizers: ids, exact round trips, save/load, spec strings, missing dependency."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from lintime.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    MissingDependencyError,
    get_tokenizer,
    load_tokenizer,
    open_corpus,
    stdlib_root,
)

SAMPLE = "def f(x):\r\n\treturn x + 1  # é 😀 '<eos>' <mask> [MASK]\n"


def _python_texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted((stdlib_root() / "json").glob("*.py"))]


def test_byte_tokenizer_ids_and_round_trip(tmp_path: Path):
    tok = ByteTokenizer()
    assert tok.vocab_size == 260 and tok.special_ids == (256, 257, 258, 259)
    assert tok.bits_per_byte and tok.name == "byte" and tok.token_dtype == np.uint8
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == SAMPLE
    (batch,) = tok.encode_batch([SAMPLE])
    assert batch.dtype == np.uint8 and batch.tolist() == ids
    assert load_tokenizer(tok.save(tmp_path / "t")) == tok


def test_get_tokenizer_specs_and_errors(tmp_path: Path):
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    tok = ByteTokenizer()
    assert get_tokenizer(tok) is tok
    assert isinstance(get_tokenizer(str(ByteTokenizer().save(tmp_path / "b"))), ByteTokenizer)
    with pytest.raises(DataError, match="unknown tokenizer"):
        get_tokenizer("wordpiece")
    with pytest.raises(DataError, match="no corpus|none was given"):
        get_tokenizer("bpe:500")
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing")


def test_bpe_train_save_load_round_trip(tmp_path: Path):
    pytest.importorskip("tokenizers")
    tok = BPETokenizer.train(_python_texts(), vocab_size=400)
    assert tok.vocab_size == 400 and not tok.bits_per_byte
    assert len(set(tok.special_ids)) == 4 and all(0 <= i < 400 for i in tok.special_ids)
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE  # byte-level: exact, literal "<eos>" stays text
    assert not set(ids) & set(tok.special_ids)
    assert len(ids) < len(SAMPLE.encode("utf-8"))  # merges do compress
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == SAMPLE

    again = BPETokenizer.train(_python_texts(), vocab_size=400)
    assert again.name == tok.name  # training is deterministic

    loaded = load_tokenizer(tok.save(tmp_path / "bpe"))
    assert isinstance(loaded, BPETokenizer) and loaded.name == tok.name
    assert loaded.special_ids == tok.special_ids and loaded.encode(SAMPLE) == ids
    (arr,) = loaded.encode_batch([SAMPLE])
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert get_tokenizer(f"bpe:{tmp_path / 'bpe'}").name == tok.name


def test_bpe_loads_foreign_folders(tmp_path: Path):
    tk = pytest.importorskip("tokenizers")
    tok = BPETokenizer.train(_python_texts(), vocab_size=400)
    # tokenizer.json alone (no lintime metadata): roles found by their names
    (tmp_path / "hf").mkdir()
    tok.hf_tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    hf = BPETokenizer.load(tmp_path / "hf")
    assert hf.special_ids == tok.special_ids and hf.encode(SAMPLE) == tok.encode(SAMPLE)

    # GPT-2 style vocab.json + merges.txt with <|endoftext|> only: it serves as bos and eos,
    # pad and mask are appended after the vocabulary
    model = tk.Tokenizer(tk.models.BPE())
    model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=350, special_tokens=["<|endoftext|>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    model.train_from_iterator(_python_texts(), trainer)
    (tmp_path / "gpt2").mkdir()
    model.model.save(str(tmp_path / "gpt2"))
    g = load_tokenizer(tmp_path / "gpt2")
    eot = model.token_to_id("<|endoftext|>")
    assert g.bos_id == g.eos_id == eot
    assert {g.pad_id, g.mask_id} == {350, 351} and g.vocab_size == 352
    assert g.decode(g.encode(SAMPLE)) == SAMPLE
    assert g.decode([g.bos_id] + g.encode("x = 1") + [g.pad_id]) == "x = 1"


def test_bpe_trained_on_the_train_split_is_cached(tmp_path: Path, make_corpus):
    pytest.importorskip("tokenizers")
    make_corpus(tmp_path / "c", n_files=30, max_chars=2000)
    corpus = open_corpus(tmp_path / "c")
    tok = get_tokenizer("bpe:300", corpus=corpus, cache_dir=tmp_path / "cache", quiet=True)
    (saved,) = (tmp_path / "cache").glob("tokenizer-bpe300-*")
    meta = json.loads((saved / "lintime_tokenizer.json").read_text())
    assert meta["kind"] == "bpe"
    again = get_tokenizer("bpe:300", corpus=corpus, cache_dir=tmp_path / "cache", quiet=True)
    assert again.name == tok.name and tok.vocab_size <= 300


def test_bpe_without_tokenizers_is_a_clear_error(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(MissingDependencyError, match=r"tokenizers.*lintime\[bpe\]"):
        BPETokenizer.train(["abc"], vocab_size=300)
    with pytest.raises(MissingDependencyError):
        BPETokenizer.load(tmp_path)
