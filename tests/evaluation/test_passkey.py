"""lintime.evaluation.tasks.passkey: the prompt (length, depth, held-out filler), the greedy
decoding through the state against full forwards, and the scoring against a model that reads the
key from its context and one that does not."""

from __future__ import annotations

import re
import types

import pytest
import torch
from torch import nn

from lintime.data import ByteTokenizer
from lintime.evaluation.tasks.passkey import (
    NEEDLE,
    QUESTION,
    FillerStream,
    evaluate_passkey,
    filler_text,
    format_passkey,
    greedy_continuations,
    make_prompt,
    trial_key,
)
from lintime.models import CausalLM, get_preset

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def stream():
    return FillerStream(filler_text(min_chars=200_000), TOK)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_length_depth_and_key(stream, depth):
    L = 700
    key, rng = trial_key(0, L, depth, 2, 5)
    assert len(key) == 5 and key.isdigit() and key[0] != "0"
    ids = make_prompt(stream, TOK, L, depth, key, rng)
    assert len(ids) == L and ids[0] == TOK.bos_id
    text = TOK.decode(ids[1:])
    needle = NEEDLE.format(key=key)
    F = L - 1 - len(needle) - len(QUESTION)
    assert text.endswith(QUESTION)
    assert text.index(needle) == round(depth * F)  # byte tokenizer: tokens are bytes
    assert text.count(key) == 2
    # the same trial is the same prompt; another trial another key or filler
    key2, rng2 = trial_key(0, L, depth, 2, 5)
    assert make_prompt(stream, TOK, L, depth, key2, rng2) == ids


def test_filler_is_the_held_out_split():
    from lintime.data import open_corpus

    corpus = open_corpus("stdlib")
    first = next(iter(corpus.documents("test")))
    assert corpus.split_of(first.key) == "test"
    assert filler_text(min_chars=1)[0] == first.text


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "gla-tiny"])
def test_greedy_through_the_state_equals_full_forwards(preset):
    torch.manual_seed(0)
    model = CausalLM(get_preset(preset, vocab_size=TOK.vocab_size)).eval()
    prompts = torch.randint(0, 256, (2, 37))
    got = greedy_continuations(model, prompts, 4, chunk_size=16)
    seq = prompts.clone()
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert got == seq[:, 37:].tolist()


class _Reader(nn.Module):
    """A fake causal LM with the whole context as its state: after the question it spells the
    key it finds in the needle (``reads``), or zeros."""

    causal = True

    def __init__(self, reads: bool):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=TOK.vocab_size, position="none", max_positions=0)
        self.w = nn.Parameter(torch.zeros(()))
        self.reads = reads

    def init_state(self, batch_size, device=None, dtype=None):
        return torch.zeros(batch_size, 0, dtype=torch.long)

    def forward(self, ids, state=None, return_state=False, cu_seqlens=None):
        ctx = torch.cat([state if state is not None else self.init_state(ids.shape[0]), ids], 1)
        logits = torch.zeros(*ids.shape, TOK.vocab_size)
        for b in range(ids.shape[0]):
            text = TOK.decode(ctx[b].tolist())
            found = re.search(r"pass key is (\d+)\. Remember", text)
            typed = text.rpartition(QUESTION)[2]
            key = found.group(1) if (found and self.reads) else "0" * 9
            nxt = key[len(typed)] if len(typed) < len(key) else "\n"
            logits[b, -1, ord(nxt)] = 1.0
        return (logits, ctx) if return_state else logits


def test_scores_a_reader_and_a_forgetter():
    kw = dict(context_lens=(300, 600), depths=(0.0, 0.5, 1.0), trials=3, batch_size=2)
    good = evaluate_passkey(_Reader(True), TOK, **kw)
    assert [c.accuracy for c in good.cells] == [1.0] * 6
    assert all(len(a) == 5 for c in good.cells for a in c.answers)
    bad = evaluate_passkey(_Reader(False), TOK, **kw)
    assert [c.accuracy for c in bad.cells] == [0.0] * 6
    table = format_passkey(good)
    assert "depth 0.5" in table and table.splitlines()[1].split()[0] == "300"
    with pytest.raises(ValueError, match="shorter than the needle"):
        evaluate_passkey(_Reader(True), TOK, context_lens=(50,), depths=(0.5,), trials=1)
