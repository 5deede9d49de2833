"""lintime.evaluation: bits per byte / perplexity against a hand computation, one exact pass."""

from __future__ import annotations

import math

import pytest
import torch
from gen_helpers import SMALL_CHUNKS, tiny_model

from lintime.data import ByteTokenizer, prepare
from lintime.evaluation import evaluate, load_split, select_documents

DOCS = ["héllo wörld", "x", "def f(a):\n    return a + 1\n" * 3, "日本語のテキスト 🙂", "ab" * 40]


@pytest.fixture(scope="module")
def byte_split(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    for i, text in enumerate(DOCS):
        (root / "corpus" / f"doc{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (root / "corpus" / f"doc{i}.txt").write_text(text, encoding="utf-8")
    # val_fraction 0.99: every document of this corpus hashes into validation
    ds = prepare(root / "corpus", "byte", root / "cache", splits=("validation",), val_fraction=0.99,
                 test_fraction=0.0, quiet=True)["validation"]
    assert len(ds) == len(DOCS)
    return ds


def hand_nll(model, docs: list[list[int]], tok, L: int) -> float:
    """sum of -ln p over every target: each document [bos] d [eos] cut into windows of L
    inputs from its start, each window run alone (no packing, no state), fp64 log-softmax."""
    total = 0.0
    for d in docs:
        seq = [tok.bos_id] + d + [tok.eos_id]
        inputs, targets = seq[:-1], seq[1:]
        for s in range(0, len(inputs), L):
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([inputs[s : s + L]]))[0].double(), -1)
            total -= sum(float(logp[j, t]) for j, t in enumerate(targets[s : s + L]))
    return total


@pytest.mark.parametrize("name", ["gla-tiny", "transformer-pp-tiny", "flash-tiny", "vq-tiny"])
def test_bits_per_byte_equals_a_hand_computation(byte_split, name):
    model, tok = tiny_model(name, **SMALL_CHUNKS.get(name, {})), ByteTokenizer()
    docs = [byte_split[i].tolist() for i in range(len(byte_split))]
    n_bytes = sum(len(t.encode()) for t in DOCS)
    n_targets = sum(len(d) + 1 for d in docs)
    report = evaluate(model, byte_split, [8, 64, 4096], batch_tokens=48)
    assert (report.n_docs, report.n_bytes, report.n_targets) == (len(DOCS), n_bytes, n_targets)
    for r in report.results:
        nll = hand_nll(model, docs, tok, r.context_len)
        assert r.n_targets == n_targets  # every target exactly once
        assert r.bits_per_byte == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-6)
        assert r.loss == pytest.approx(nll / n_targets, rel=1e-6)
        assert r.perplexity == pytest.approx(math.exp(nll / n_targets), rel=1e-6)
        assert r.bits_per_token == pytest.approx(r.loss / math.log(2), rel=1e-12)
        assert r.n_windows == sum(math.ceil((len(d) + 1) / r.context_len) for d in docs)
    # the packing (batch_tokens) does not change the score
    again = evaluate(model, byte_split, [8], batch_tokens=1)
    assert again.results[0].bits_per_byte == pytest.approx(report.results[0].bits_per_byte, rel=1e-6)


def test_max_tokens_takes_whole_documents(byte_split):
    lengths = [len(byte_split[i]) for i in range(len(byte_split))]
    assert select_documents(byte_split, None) == len(DOCS)
    assert select_documents(byte_split, 1) == 1
    assert select_documents(byte_split, lengths[0] + 1) == 1  # exactly the first document's targets
    assert select_documents(byte_split, lengths[0] + 2) == 2
    assert select_documents(byte_split, 10**9) == len(DOCS)
    model, tok = tiny_model("linear-tiny"), ByteTokenizer()
    report = evaluate(model, byte_split, [16], max_tokens=lengths[0] + 2)
    assert report.n_docs == 2 and report.n_bytes == len(DOCS[0].encode()) + len(DOCS[1].encode())
    nll = hand_nll(model, [byte_split[0].tolist(), byte_split[1].tolist()], tok, 16)
    assert report.results[0].bits_per_byte == pytest.approx(nll / math.log(2) / report.n_bytes, rel=1e-6)


def test_context_longer_than_a_learned_position_table_is_skipped(byte_split):
    model = tiny_model("linear-tiny")  # learned positions: 1024
    report = evaluate(model, byte_split, [32, 2048])
    assert report.results[0].skipped is None and math.isfinite(report.results[0].bits_per_byte)
    assert "position table (1024)" in report.results[1].skipped
    d = report.to_dict()
    assert d["results"][1]["bits_per_byte"] is None  # JSON-safe (no NaN)


def test_bpe_reports_perplexity_and_bytes_of_the_text(tmp_path):
    pytest.importorskip("tokenizers")
    from lintime.data import BPETokenizer
    from lintime.models import CausalLM, get_preset

    tok = BPETokenizer.train(DOCS * 4, vocab_size=300, min_frequency=1)
    for i, text in enumerate(DOCS):
        (tmp_path / "c" / f"doc{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / f"doc{i}.txt").write_text(text, encoding="utf-8")
    ds = prepare(tmp_path / "c", tok, tmp_path / "cache", splits=("validation",), val_fraction=0.99,
                 test_fraction=0.0, quiet=True)["validation"]
    torch.manual_seed(0)
    model = CausalLM(get_preset("gla-tiny", vocab_size=tok.vocab_size)).eval()
    full = evaluate(model, ds, [16])
    n_bytes = sum(len(t.encode()) for t in DOCS)
    assert full.n_bytes == n_bytes
    docs = [ds[i].tolist() for i in range(len(ds))]
    nll = hand_nll(model, docs, tok, 16)
    r = full.results[0]
    assert r.bits_per_byte == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-6)
    assert r.perplexity == pytest.approx(math.exp(nll / sum(len(d) + 1 for d in docs)), rel=1e-6)
    # a subset counts the bytes of its documents by decoding them
    part = evaluate(model, ds, [16], max_tokens=1)
    assert tok.decode(docs[0]) in DOCS
    assert part.n_docs == 1 and part.n_bytes == len(tok.decode(docs[0]).encode())


def test_evaluate_errors(byte_split):
    model = tiny_model("gla-tiny")
    with pytest.raises(ValueError, match="context lengths"):
        evaluate(model, byte_split, [0])
    with pytest.raises(ValueError, match="max_tokens"):
        evaluate(model, byte_split, [8], max_tokens=0)
    with pytest.raises(ValueError, match="split must be one of"):
        load_split({}, ByteTokenizer(), "train")
    with pytest.raises(ValueError, match="--data"):
        load_split({"train": {}}, ByteTokenizer(), "validation")
