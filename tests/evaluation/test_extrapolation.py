"""lintime.evaluation.tasks.extrapolation: bits per byte per position bucket against a hand
computation over the same whole windows."""

from __future__ import annotations

import math

import pytest
import torch

from lintime.data import ByteTokenizer, prepare
from lintime.evaluation.tasks.extrapolation import evaluate_extrapolation, format_extrapolation, windows
from lintime.models import CausalLM, get_preset

DOCS = ["short", "def f(x):\n    return x * 2\n" * 6, "héllo wörld " * 9, "z" * 20]
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("extrap")
    for i, text in enumerate(DOCS):
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"d{i}.txt").write_text(text, encoding="utf-8")
    return prepare(root / "corpus", "byte", root / "cache", splits=("validation",), val_fraction=0.99,
                   test_fraction=0.0, quiet=True)["validation"]


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "gla-tiny"])
def test_buckets_equal_a_hand_computation(split, preset):
    torch.manual_seed(0)
    model = CausalLM(get_preset(preset, vocab_size=TOK.vocab_size)).eval()
    trained, factor = 8, 4  # windows of 32, buckets of 8
    rep = evaluate_extrapolation(model, split, tokenizer=TOK, trained_len=trained, factor=factor, max_windows=None,
                                 batch_tokens=70)
    wins = list(windows(split, 32, TOK.bos_id, TOK.eos_id, None))
    # whole windows only: documents of >= 32 inputs, floor((n + 1) / 32) windows each
    assert rep.n_windows == len(wins) == sum((len(split[i]) + 1) // 32 for i in range(len(split)))
    assert rep.n_docs == len({w[2] for w in wins}) == sum(len(split[i]) + 1 >= 32 for i in range(len(split)))
    nll, nbytes = [0.0] * 4, [0] * 4
    with torch.no_grad():
        for x, y, _ in wins:
            logp = torch.log_softmax(model(torch.tensor(x)[None])[0].double(), -1)
            for p in range(32):
                nll[p // 8] -= float(logp[p, y[p]])
                nbytes[p // 8] += int(y[p] < 256)
    assert [(b.start, b.stop) for b in rep.buckets] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    for k, b in enumerate(rep.buckets):
        assert b.n_targets == 8 * len(wins) and b.n_bytes == nbytes[k]
        assert b.bits_per_byte == pytest.approx(nll[k] / math.log(2) / nbytes[k], rel=1e-6)
        assert b.bits_per_token == pytest.approx(nll[k] / math.log(2) / b.n_targets, rel=1e-6)
    text = format_extrapolation(rep)
    assert "8-15*" in text and "0-7 " in text.replace("0-7*", "")


def test_no_long_document_and_learned_positions_are_reported(split):
    model = CausalLM(get_preset("transformer-pp-tiny", vocab_size=TOK.vocab_size)).eval()
    rep = evaluate_extrapolation(model, split, tokenizer=TOK, trained_len=256, factor=16)
    assert rep.skipped == "no document of the split holds 4096 tokens" and rep.buckets == []
    learned = CausalLM(get_preset("transformer-tiny", vocab_size=TOK.vocab_size, position="learned",
                                  max_positions=16)).eval()
    rep = evaluate_extrapolation(learned, split, tokenizer=TOK, trained_len=16, factor=2)
    assert rep.skipped == "longer than the model's learned position table (16)"
