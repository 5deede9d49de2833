"""CUDA-graph decoding (``lintime.generation.graphs``): greedy generation through graphs equals the
eager path token for token for every family, two live generations never share a buffer, and a
replayed step makes no host sync.  The loop itself (the same buffers, run eagerly) is also checked
on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from gen_helpers import scripted
from static_helpers import family_presets, small_model

from lintime.data import ByteTokenizer
from lintime.generation import GenerationConfig, generate, prefill, stream
from lintime.generation.graphs import DecodeLoop, build_loop
from lintime.generation.static import StaticDecoder

PRESETS = family_presets()
CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
SIZE = 16  # chunk / block sizes on CUDA: the Triton kernels' smallest tiles


def _loop(m, ids, max_steps, graph, **sampling):
    logits, state = prefill(m, ids)
    dec = StaticDecoder(m, state, ids.shape[1] + max_steps)
    seeds = torch.arange(ids.shape[0], device=ids.device)
    return build_loop(dec, logits, seeds, max_steps, graph=graph, **sampling)


def _run(loop, n):
    for _ in range(n):
        loop.advance()
    return loop.tokens[:, :n].tolist()


def test_two_loops_own_their_buffers_and_run_interleaved_cpu():
    m = small_model("flash-tiny+fta")
    g = torch.Generator().manual_seed(0)
    a_ids, b_ids = torch.randint(0, 256, (2, 7), generator=g), torch.randint(0, 256, (1, 12), generator=g)
    with torch.no_grad():
        alone_a = _run(_loop(m, a_ids, 20, False, temperature=1.0), 20)
        alone_b = _run(_loop(m, b_ids, 20, False, temperature=0.0), 20)
        la, lb = _loop(m, a_ids, 20, False, temperature=1.0), _loop(m, b_ids, 20, False, temperature=0.0)
        assert not {t.data_ptr() for t in la.buffers()} & {t.data_ptr() for t in lb.buffers()}
        for _ in range(20):
            la.advance()
            lb.advance()
        with pytest.raises(RuntimeError, match="all 20 steps taken"):
            la.advance()
    assert la.tokens.tolist() == alone_a and lb.tokens.tolist() == alone_b


def test_loop_validates_its_inputs():
    m = small_model("gla-tiny")
    with torch.no_grad():
        logits, state = prefill(m, torch.randint(0, 256, (2, 3)))
        dec = StaticDecoder(m, state, 10)
        with pytest.raises(ValueError, match="2 state rows"):
            DecodeLoop(dec, logits[:1], torch.arange(2), 5)


@cuda
@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_generation_through_graphs_equals_eager(preset):
    m, tok = small_model(preset, size=SIZE, device="cuda"), ByteTokenizer()
    base = dict(max_new_tokens=3 * SIZE + 5, temperature=0.0, num_samples=2, stop_at_eos=False, prefill_chunk=7)
    prompts = ["hello world", "x"]
    eager = generate(m, tok, prompts, GenerationConfig(decode="eager", **base))
    stats: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture failure (eager fallback) fails the test
        graph = generate(m, tok, prompts, GenerationConfig(decode="graph", **base), stats=stats)
    assert stats["decode_path"] == "graph"
    assert [s.token_ids for s in graph] == [s.token_ids for s in eager]


@cuda
@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_replayed_steps_make_no_host_sync(preset):
    m = small_model(preset, size=SIZE, device="cuda")
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    with torch.no_grad():
        loop = _loop(m, ids, 2 * SIZE + 3, True, temperature=1.0, top_k=20, top_p=0.9)
        assert loop.graph is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2 * SIZE + 3):
                loop.advance()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert loop.step.item() == 2 * SIZE + 3


@cuda
@needs_cuda
def test_two_live_graph_generations_do_not_share_buffers():
    m, tok = small_model("flash-tiny+fta", size=SIZE, device="cuda"), ByteTokenizer()
    g = torch.Generator().manual_seed(0)
    a_ids = torch.randint(0, 256, (2, 7), generator=g).cuda()
    b_ids = torch.randint(0, 256, (1, 12), generator=g).cuda()
    with torch.no_grad():
        alone_a = _run(_loop(m, a_ids, 30, True, temperature=1.0), 30)
        alone_b = _run(_loop(m, b_ids, 30, True, temperature=0.0), 30)
        la, lb = _loop(m, a_ids, 30, True, temperature=1.0), _loop(m, b_ids, 30, True, temperature=0.0)
        assert la.graph is not None and lb.graph is not None
        assert not {t.data_ptr() for t in la.buffers()} & {t.data_ptr() for t in lb.buffers()}
        for _ in range(30):
            la.advance()
            lb.advance()
    assert la.tokens.tolist() == alone_a and lb.tokens.tolist() == alone_b
    # two interleaved streams give what each gives alone
    cfg = GenerationConfig(max_new_tokens=25, temperature=1.0, seed=4, stop_at_eos=False)
    ref = {p: "".join(x.text for x in stream(m, tok, p, cfg)) for p in ("ab", "xyz")}
    live = {"ab": stream(m, tok, "ab", cfg), "xyz": stream(m, tok, "xyz", cfg)}
    got = {"ab": "", "xyz": ""}
    while live:  # one piece of each in turn: both generations alive at once
        for p in list(live):
            piece = next(live[p], None)
            if piece is None:
                del live[p]
            else:
                got[p] += piece.text
    assert got == ref


def test_finished_rows_move_to_a_smaller_loop():
    """On the static path, rows that end (eos) leave the batch at the next host read once at most
    half of it still runs: the next steps run a smaller loop, the samples are unchanged."""
    tok = ByteTokenizer()
    cfg = dict(temperature=0, num_samples=2, max_new_tokens=40)
    eager = generate(scripted("xyz12345678"), tok, ["xyz", "x"], GenerationConfig(decode="eager", **cfg))
    model = scripted("xyz12345678")
    static = generate(model, tok, ["xyz", "x"], GenerationConfig(decode="static", sync_every=2, **cfg))
    assert [(s.text, s.finish_reason) for s in static] == [(s.text, s.finish_reason) for s in eager]
    assert [s.text for s in static] == ["12345678", "12345678", "yz12345678", "yz12345678"]
    rows = [b for b, t in model.calls[1:]]  # calls[0] is the packed prefill
    # reads after 1, 2, 2, ... steps: the first prompt's samples end with their 9th token (eos),
    # seen at the read after step 9; from there two rows run, until eos after 11 tokens
    assert rows == [4] * 9 + [2] * 2, rows
