"""The engine's decoding step per batch bucket replayed from a CUDA graph (``Engine(graphs=True)``, the default on
CUDA): on every family's tiny model (fp32), greedy output of staggered requests with graphs equals the eager
engine's and each request's output alone; each bucket captures (no eager fallback).  On the CPU: graphs are
refused with one clear error, and off by default."""

from __future__ import annotations

import pytest
import torch
from test_engine import MAX_TOKENS, PROMPTS, TOK, WAIT, collect, tiny
from tiny_presets import FAMILY_TINY_PRESETS

from lintime.serving import Engine, Request
from lintime.serving.slots import SlotStates


def _run(model, requests, **kw):
    eng = Engine(model, TOK, capacity=128, **kw).start()
    try:
        handles = [eng.submit(r) for r in requests[:6]]
        next(handles[-1].iter(timeout=WAIT))  # the rest join a running batch
        handles += [eng.submit(r) for r in requests[6:]]
        out = [collect(h)[:3] for h in handles]
        captured = {n: g is not None for n, g in eng._slots._graphs.items()}
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    return out, captured


@pytest.mark.cuda
@pytest.mark.parametrize("preset", [*FAMILY_TINY_PRESETS, "flash-tiny+fta"])
def test_graph_steps_equal_eager_steps_and_alone(preset):
    model = tiny(preset).cuda()
    requests = [Request(p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, MAX_TOKENS)]
    try:
        graphed, captured = _run(model, requests, max_batch=16, graphs=True)
        eager, none = _run(model, requests, max_batch=16, graphs=False)
        alone, _ = _run(model, requests[:1], max_batch=1, graphs=True)
    finally:
        model.cpu()
    assert none == {}
    assert captured and all(captured.values()), f"{preset}: buckets that fell back to eager steps: {captured}"
    assert len(captured) >= 2, "the batch never changed bucket"
    assert graphed == eager, preset
    assert graphed[0] == alone[0], preset


def test_graphs_need_cuda():
    model = tiny("gla-tiny")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SlotStates(model, 4, 32, torch.device("cpu"), graphs=True)
    eng = Engine(model, TOK, capacity=32)
    assert eng.graphs is False  # the default off CUDA
