"""prefill / decode_one_token: decoding through the state equals recomputing the whole sequence."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import FAMILY_PRESETS, SMALL_CHUNKS, tiny_model

from lintime.data import ByteTokenizer
from lintime.generation import GenerationConfig, decode_one_token, generate, prefill
from lintime.generation import decode as decode_mod
from lintime.generation.decode import prefill_piece, state_nbytes


def _model(name):
    return tiny_model(name, **SMALL_CHUNKS.get(name, {}))


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_greedy_generation_equals_argmax_of_full_recomputation_at_every_step(name):
    model, tok = _model(name), ByteTokenizer()
    prompt = "def f"
    cfg = GenerationConfig(max_new_tokens=20, temperature=0, stop_at_eos=False, prefill_chunk=2)
    (s,) = generate(model, tok, prompt, cfg)
    assert len(s.token_ids) == 20 and s.finish_reason == "length"
    ids = [tok.bos_id] + tok.encode(prompt) + s.token_ids
    P = 1 + len(prompt)
    with torch.no_grad():
        full = model(torch.tensor([ids]))[0]  # [T, V]: the whole sequence, no state
    for t, token in enumerate(s.token_ids):
        with torch.no_grad():
            recomputed = model(torch.tensor([ids[: P + t]]))[0, -1]  # from scratch, no state
        assert token == int(recomputed.argmax()), f"step {t}"
        torch.testing.assert_close(full[P + t - 1], recomputed, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_chunked_prefill_equals_one_shot_prefill_packed_prompts(name):
    model = _model(name)
    g = torch.Generator().manual_seed(1)
    lens = [5, 13, 1, 9]
    ids = torch.randint(0, 256, (1, sum(lens)), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    nxt = torch.randint(0, 256, (len(lens),), generator=g)
    with torch.no_grad():
        ref_logits, ref_state = prefill(model, ids, None, None, cu_seqlens=cu)
        ref_next, _ = decode_one_token(model, nxt, ref_state)
        # each prompt alone, without packing
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            alone, _ = prefill(model, ids[:, a:b])
            torch.testing.assert_close(alone[0], ref_logits[n], rtol=1e-5, atol=1e-5)
        for C in (1, 3, 8, 100):
            logits, state = prefill(model, ids, None, C, cu_seqlens=cu)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            assert state.offset.tolist() == lens
            after, _ = decode_one_token(model, nxt, state)  # the state continues identically
            torch.testing.assert_close(after, ref_next, rtol=1e-5, atol=1e-5)


def test_prefill_rows_chunked_and_continuing_a_state():
    model = _model("gla-tiny")
    ids = torch.randint(0, 256, (3, 12))
    with torch.no_grad():
        full = model(ids)  # [3, 12, V]
        one, _ = prefill(model, ids[:, :11])
        chunked, state = prefill(model, ids[:, :11], chunk_size=4)
        torch.testing.assert_close(one, full[:, 10], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked, full[:, 10], rtol=1e-5, atol=1e-5)
        step, _ = decode_one_token(model, ids[:, 11], state)
        torch.testing.assert_close(step, full[:, 11], rtol=1e-5, atol=1e-5)
        # prefill continues a given state: two halves == the whole
        _, half = prefill(model, ids[:, :6])
        second, _ = prefill(model, ids[:, 6:], half, 2)  # tokens 6..11
        torch.testing.assert_close(second, full[:, -1], rtol=1e-5, atol=1e-5)


def _pieces_agree(model, device="cpu", tol=1e-4):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 19), generator=g).to(device)
    nxt = torch.randint(0, 256, (2, 2), generator=g).to(device)
    with torch.no_grad():
        full = model(torch.cat([ids, nxt], 1))  # [2, 21, V]: no state
        for C in (None, 4, 1):
            logits, state = prefill(model, ids, None, C)
            torch.testing.assert_close(logits, full[:, 18], rtol=tol, atol=tol, msg=f"C={C}")
            assert state.offset.tolist() == [19, 19]
            for t in range(2):
                logits, state = decode_one_token(model, nxt[:, t], state)
                torch.testing.assert_close(logits, full[:, 19 + t], rtol=tol, atol=tol, msg=f"C={C} step {t}")


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_prefill_in_one_piece_in_pieces_and_token_by_token_agree(name):
    """The same prompt prefilled in one call, in pieces of 4 and one token per call: the last logits equal the
    full-sequence forward's, and the three states continue identically (two decoding steps)."""
    _pieces_agree(_model(name))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["flash-tiny", "gla-tiny", "transformer-pp-tiny"])
def test_prefill_pieces_agree_on_the_fused_kernels(name):
    """On CUDA (fp32: the kernels' ieee path) the prefill calls go through the fused kernels with an initial
    state; pieces of 4 leave a partial FLASH chunk that the next call prepends."""
    _pieces_agree(_model(name).cuda(), "cuda", tol=2e-4)


def test_prefill_piece_rule():
    budget = decode_mod.PREFILL_TOKENS
    assert prefill_piece(1, budget) == budget and prefill_piece(3, 5) == 5  # whole prompts that fit: one call
    for rows, tokens in ((1, budget + 1), (3, budget), (64, 4 * budget), (budget * 2, 10)):
        c = prefill_piece(rows, tokens)
        assert c >= 1 and c & (c - 1) == 0, (rows, tokens, c)  # a power of two: pieces end on chunk boundaries
        assert rows * c <= budget or c == 1, (rows, tokens, c)
        assert rows * 2 * c > budget, (rows, tokens, c)  # the largest such


def test_automatic_prefill_splits_above_the_budget_and_projects_only_last_tokens(monkeypatch):
    model = _model("flash-tiny")
    ids = torch.randint(0, 256, (2, 19))
    calls, heads = [], []
    backbone, logits_of = model.backbone.forward, model._logits
    monkeypatch.setattr(model.backbone, "forward", lambda x, *a, **k: calls.append(x.shape[1]) or backbone(x, *a, **k))
    monkeypatch.setattr(model, "_logits", lambda h: heads.append(tuple(h.shape)) or logits_of(h))
    with torch.no_grad():
        whole, _ = prefill(model, ids)
        assert calls == [19] and heads == [(2, model.config.d_model)]
        monkeypatch.setattr(decode_mod, "PREFILL_TOKENS", 8)  # 2 rows x 4 tokens per call
        calls.clear()
        split, state = prefill(model, ids, None, 0)
        assert calls == [4, 4, 4, 4, 3]
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
        assert state.offset.tolist() == [19, 19]


def test_prefill_rejects_bad_input():
    model = _model("linear-tiny")
    with pytest.raises(ValueError, match="at least one token"):
        prefill(model, torch.zeros(1, 3, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, torch.zeros(1, 3, dtype=torch.long), chunk_size=-1)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        prefill(model, torch.zeros(3, dtype=torch.long))


LINEAR_TIME = ["flash-tiny", "mc-tfm-pp-tiny", "gla-tiny", "linear-tiny", "performer-tiny", "vq-tiny"]


@pytest.mark.parametrize("name,grows", [(n, False) for n in LINEAR_TIME] + [("transformer-pp-tiny", True)])
def test_state_memory_per_token(name, grows):
    """Linear-time families: the decoding state has the same size after 8 and after 40
    tokens (constant memory per token); softmax attention's KV cache grows."""
    model, tok = _model(name), ByteTokenizer()
    sizes = []
    for n in (8, 40):
        stats = {}
        generate(model, tok, "x", GenerationConfig(max_new_tokens=n, temperature=0, stop_at_eos=False), stats=stats)
        sizes.append(stats["state_bytes_final"])
        assert stats["new_tokens"] == n and stats["prompt_tokens"] == 2
    assert (sizes[1] > sizes[0]) == grows, sizes
    assert state_nbytes(model.init_state(2)) >= 0
