"""Streaming: incremental detokenisation (partial UTF-8), stop strings, eos, streamed == returned text."""

from __future__ import annotations

import random

import pytest
from gen_helpers import scripted, tiny_model

from lintime.data import ByteTokenizer
from lintime.generation import (
    Detokenizer,
    GenerationConfig,
    StopMatcher,
    generate,
    stream,
)

TEXT = "héllo → 日本語 🙂 done"


def test_byte_detokenizer_waits_for_whole_characters():
    tok = ByteTokenizer()
    d = Detokenizer(tok)
    pieces = [d.push(i) for i in tok.encode(TEXT)] + [d.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    # the three bytes of "→" give "", "", "→"
    arrow = tok.encode("→")
    d = Detokenizer(tok)
    assert [d.push(i) for i in arrow] == ["", "", "→"]


def test_byte_detokenizer_equals_decode_on_invalid_bytes():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice([rng.randrange(256), 0xC3, 0xE2, 0x82, 0xF0, 0x9F, tok.eos_id]) for _ in range(rng.randint(0, 12))]
        d = Detokenizer(tok)
        assert "".join([d.push(i) for i in ids] + [d.flush()]) == tok.decode(ids)


def test_bpe_detokenizer_equals_decode():
    pytest.importorskip("tokenizers")
    from lintime.data import BPETokenizer

    tok = BPETokenizer.train([TEXT * 3, "日本語 and 🙂🙂 again", "plain ascii text here"] * 5, vocab_size=300, min_frequency=1)
    for text in (TEXT, "🙂日本 → héllo", "xyz 語"):
        ids = tok.encode(text)
        d = Detokenizer(tok)
        pieces = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_possible_stop_prefixes():
    m = StopMatcher(["\n\n", "END"])
    shown = []
    for ch in "ab\ncd\nE":
        out, stopped = m.push(ch)
        assert not stopped
        shown.append(out)
    # each "\n" was held until the next character showed it does not start "\n\n"; the final
    # "E" is held: it may start "END"
    assert shown == ["a", "b", "", "\nc", "d", "", "\n"]
    out, stopped = m.push("N")
    assert (out, stopped) == ("", False)  # "EN" still undecided
    out, stopped = m.push("X!")
    assert (out, stopped) == ("ENX!", False)  # decided: not a stop string
    out, stopped = m.push("..END tail")
    assert (out, stopped) == ("..", True)  # text before the stop string only


def test_stop_matcher_earliest_stop_and_flush():
    m = StopMatcher(["bb", "ab"])
    assert m.push("xxabb") == ("xx", True)  # "ab" starts before "bb"
    m = StopMatcher(["stop"])
    assert m.push("the st") == ("the ", False)
    assert m.flush() == "st"  # the sample ended without the stop string: release the held text
    assert StopMatcher([]).push("anything") == ("anything", False)


def test_generation_ends_at_eos_at_stop_strings_and_at_the_length_limit():
    tok = ByteTokenizer()
    model = scripted("hello\n\nworld", prompt="ab")
    greedy = {"temperature": 0}
    (s,) = generate(model, tok, "ab", GenerationConfig(**greedy))
    assert (s.text, s.finish_reason) == ("hello\n\nworld", "eos")
    assert s.token_ids == tok.encode("hello\n\nworld") + [tok.eos_id]
    (s,) = generate(model, tok, "ab", GenerationConfig(stop=("\n\n",), **greedy))
    assert (s.text, s.finish_reason) == ("hello", "stop")
    (s,) = generate(model, tok, "ab", GenerationConfig(stop=("wor", "lo\n"), **greedy))
    assert (s.text, s.finish_reason) == ("hel", "stop")
    (s,) = generate(model, tok, "ab", GenerationConfig(max_new_tokens=3, **greedy))
    assert (s.text, s.finish_reason) == ("hel", "length")
    (s,) = generate(model, tok, "ab", GenerationConfig(max_new_tokens=0, **greedy))
    assert (s.text, s.finish_reason, s.token_ids) == ("", "length", [])
    # a stop string never completed: the held-back prefix is released at the end
    (s,) = generate(model, tok, "ab", GenerationConfig(stop=("ldx",), **greedy))
    assert (s.text, s.finish_reason) == ("hello\n\nworld", "eos")


def test_finished_rows_leave_the_batch():
    tok = ByteTokenizer()
    model = scripted("xyz12345")  # after bos: "xyz12345", eos
    # prompt "xyz" (4 tokens with bos) continues "12345"; prompt "x" continues "yz12345"
    out = generate(model, tok, ["xyz", "x"], GenerationConfig(temperature=0, num_samples=2))
    assert [(s.prompt_index, s.sample_index, s.text) for s in out] == [
        (0, 0, "12345"), (0, 1, "12345"), (1, 0, "yz12345"), (1, 1, "yz12345")]
    decode_rows = [rows for rows, t in model.calls[1:]]  # calls[0] is the packed prefill
    assert model.calls[0] == (2, 6)  # two prompts, 4 + 2 tokens (bos included), one call
    assert decode_rows == [4] * 5 + [2] * 2  # the first prompt's samples end at eos after 6 tokens


def test_streamed_pieces_equal_the_returned_text():
    tok = ByteTokenizer()
    model = tiny_model("linear-tiny")  # untrained: random bytes, many invalid UTF-8 sequences
    cfg = GenerationConfig(max_new_tokens=60, temperature=1.0, num_samples=3, seed=5, stop=("e", "\n"))
    samples = generate(model, tok, ["hi", "ho"], cfg)
    streamed: dict[int, str] = {}
    finished = {}
    for piece in stream(model, tok, ["hi", "ho"], cfg):
        assert piece.row not in finished  # nothing after a row's last piece
        streamed[piece.row] = streamed.get(piece.row, "") + piece.text
        if piece.finish_reason:
            finished[piece.row] = piece.finish_reason
    assert [streamed.get(r, "") for r in range(6)] == [s.text for s in samples]
    assert [finished[r] for r in range(6)] == [s.finish_reason for s in samples]
    # the text is decode(ids) cut at the first stop string
    for s in samples:
        full = tok.decode(t for t in s.token_ids if t != tok.eos_id)
        cut = min([i for i in (full.find("e"), full.find("\n")) if i >= 0], default=len(full))
        assert s.text == full[:cut]
    # on_text gets the same pieces
    got = []
    generate(model, tok, ["hi", "ho"], cfg, on_text=got.append)
    assert "".join(p.text for p in got if p.row == 0) == samples[0].text
