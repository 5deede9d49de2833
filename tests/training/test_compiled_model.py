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


def test_compile_blocks_in_place_with_one_notice_and_an_eager_equal_validation():
    """``compile_blocks`` (the FSDP2 form of ``--compile model``; on one process here): every block's forward compiled
    in place (the module tree and parameter names unchanged), forward + backward and a validation forward (eval mode,
    no gradient) equal to eager.  FLASH with its output bias added by the mixer (``defer_bias = False``, as
    ``wrap_model`` sets under FSDP2: the layer's out projection then has a bias) packed on the CPU: its chunk layout is
    read on the host, so the blocks fall back to graph breaks after one notice for the model."""
    from lintime.training.compile import compile_blocks
    from tolerances import assert_exact_grad

    torch.manual_seed(0)
    model = CausalLM(get_preset("flash-tiny", n_layers=2))
    model.backbone.defer_bias = False
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    targets = torch.randint(0, model.config.vocab_size, (1, 16))
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    names = [n for n, _ in model.named_parameters()]

    def run():
        model.zero_grad(set_to_none=True)
        loss = _loss(model, ids, cu, targets)
        loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(ids, cu_seqlens=cu)
        model.train()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], logits

    ref = run()
    lines: list[str] = []
    torch._dynamo.reset()
    forms = compile_blocks(model, lines.append, backend="aot_eager")
    got, again = run(), run()
    assert [n for n, _ in model.named_parameters()] == names and [b.forward for b in model.backbone.blocks] == forms
    for out in (got, again):
        assert_exact("loss", ref[0], out[0])
        for name, a, b in zip(names, ref[1], out[1]):
            assert_exact_grad(f"d{name}", a, b)
        assert_exact("validation logits", ref[2], out[2])
    assert [f.fullgraph for f in forms] == [False, False]
    assert len(lines) == 1 and "block 0 does not trace as one graph" in lines[0] and "\n" not in lines[0], lines
