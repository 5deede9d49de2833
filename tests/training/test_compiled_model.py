"""``lintime train --compile``'s wrapper: one graph where the model traces, else graph breaks after one notice."""

from __future__ import annotations

import torch

from lintime.models import CausalLM, get_preset
from tolerances import assert_exact
from lintime.training.compile import CompiledModel


def _loss(fn, ids, cu, targets):
    return fn(ids, cu_seqlens=cu, targets=targets)


def _run(name: str, packed: bool):
    torch.manual_seed(0)
    model = CausalLM(get_preset(name, n_layers=1))
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    targets = torch.randint(0, model.config.vocab_size, (1, 16))
    cu = torch.tensor([0, 6, 16], dtype=torch.int32) if packed else None
    lines: list[str] = []
    torch._dynamo.reset()
    compiled = CompiledModel(model, lines.append, "the training step", backend="aot_eager")
    out = _loss(compiled, ids, cu, targets)
    again = _loss(compiled, ids, cu, targets)  # the second call takes the compiled function chosen by the first
    ref = _loss(model, ids, cu, targets)
    assert_exact(f"{name} compiled loss", ref, out)
    assert_exact(f"{name} compiled loss, second call", ref, again)
    assert list(compiled.parameters()) == list(model.parameters())
    assert compiled.config is model.config  # attributes are the module's
    return compiled, lines


def test_traceable_model_stays_one_graph():
    compiled, lines = _run("transformer-pp-tiny", packed=True)
    assert compiled.fullgraph and lines == []


def test_graph_break_falls_back_with_one_notice():
    # the combiner layer reads the packed pieces' lengths on the host (tests/models/test_compile.py CPU_BREAKS)
    compiled, lines = _run("combiner-tiny", packed=True)
    assert not compiled.fullgraph
    assert len(lines) == 1 and "does not trace as one graph" in lines[0] and "\n" not in lines[0], lines
