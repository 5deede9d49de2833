"""``torch.compile(fullgraph=True)`` of every family's tiny model, plain and packed (issue 27 item 5).

Compiled forward + backward equal eager under the fp32 exact rule (tests/tolerances.py).  The CPU test
runs the ops' PyTorch forms (the automatic dispatch on CPU tensors); where those read ``cu_seqlens`` or data on
the host the family is named below with the reason, and the test asserts that it still breaks (remove it from the
table once it traces).  The Triton test sends the ops with Triton paths to their kernels (Triton's interpreter on
the CPU), as on CUDA: there the host work of packed calls happens inside opaque custom ops.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_presets import FAMILY_TINY_PRESETS, small_chunks

import lintime.ops.dispatch as dispatch
from lintime.models import CausalLM, get_preset
from tolerances import assert_exact, assert_exact_grad

# (family, packed) -> where the CPU path reads values on the host, which breaks the graph
CPU_BREAKS = {
    ("gau", False): "ops/gau/chunk.py: nonzero over the tile pairs",
    ("vq", False): "ops/utils.py mark_checked (Tensor.is_inference) and ops/vq value reads",
    ("vq", True): "ops/utils.py mark_checked (Tensor.is_inference) and ops/vq value reads",
    ("combiner", True): "layers/combiner.py _token_coords: the pieces' lengths as python ints",
    ("flash", True): "ops/mixed_chunk/chunk.py: the packed chunk layout (cu_seqlens.tolist())",
    ("gau", True): "ops/gau/chunk.py and ops/utils.py chunk_layout: cu_seqlens.tolist()",
    ("gla", True): "ops/utils.py chunk_layout: cu_seqlens.tolist()",
    ("linear", True): "ops/utils.py chunk_layout: cu_seqlens.tolist()",
    ("performer", True): "ops/utils.py chunk_layout: cu_seqlens.tolist()",
    ("mc_tfm", True): "layers/mc_attention.py chunk_local_softmax: chunk_layout's cu_seqlens.tolist()",
}
# families whose mixer op has a Triton path (the softmax family's packed calls trace through SDPA)
TRITON_FAMILIES = ("flash", "gau", "gla", "linear", "performer", "softmax")

T = 16
CU = (0, 6, 16)


def _model(name: str, *, narrow: bool = False) -> CausalLM:
    """One layer; ``narrow``: 32 wide with a key width of 16 where the mixer has one (the interpreter's time)."""
    torch.manual_seed(0)
    cfg = small_chunks(get_preset(name, n_layers=1, **({"d_model": 32} if narrow else {})))
    fields = {f.name for f in dataclasses.fields(cfg.mixer)}
    if narrow and "s" in fields:
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, s=16))
    if narrow and "expand_k" in fields:  # GLA: one head of K = 16, V = 32 (heads under 16 wide take the chunked form)
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, n_heads=1))
    return CausalLM(cfg)


def _inputs(model: CausalLM, packed: bool):
    gen = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, T), generator=gen)
    targets = torch.randint(0, V, (1, T), generator=gen)
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    return ids, targets, cu


def _step(fn, model, ids, targets, cu):
    """The summed loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = fn(ids, cu_seqlens=cu, targets=targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _compiled_equals_eager(model, packed: bool, what: str) -> None:
    ids, targets, cu = _inputs(model, packed)
    loss, grads = _step(model, model, ids, targets, cu)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    closs, cgrads = _step(compiled, model, ids, targets, cu)
    assert_exact(f"{what} loss", loss, closs)
    for (pname, _), g, cg in zip(model.named_parameters(), grads, cgrads):
        assert_exact_grad(f"{what} d{pname}", g, cg)


CASES = [(name, packed) for name in FAMILY_TINY_PRESETS for packed in (False, True)]


@pytest.mark.parametrize("name,packed", CASES, ids=[f"{n}-{'packed' if p else 'plain'}" for n, p in CASES])
def test_cpu_paths(name, packed):
    """Traces without a graph break and equals eager, or is one of :data:`CPU_BREAKS` and still breaks."""
    model = _model(name)
    key = (model.config.family, packed)
    what = f"{name} {'packed' if packed else 'plain'} compiled"
    if key not in CPU_BREAKS:  # fullgraph=True: a graph break fails the compile
        _compiled_equals_eager(model, packed, what)
        return
    ids, _, cu = _inputs(model, packed)
    stale = f"{what}: traces now -- remove {key} from CPU_BREAKS ({CPU_BREAKS[key]})"
    torch._dynamo.reset()
    if "backward" in CPU_BREAKS[key]:
        assert torch._dynamo.explain(model)(ids, cu_seqlens=cu).graph_break_count > 0, stale
        return
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # the forward's first break stops the trace
        torch.compile(model, fullgraph=True, backend="aot_eager")(ids, cu_seqlens=cu)


def test_cpu_breaks_name_families():
    """The table names only shipped families (a renamed family would leave a stale row)."""
    families = {get_preset(name).family for name in FAMILY_TINY_PRESETS}
    assert {fam for fam, _ in CPU_BREAKS} <= families
    assert set(TRITON_FAMILIES) <= families


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("name", [n for n in FAMILY_TINY_PRESETS if get_preset(n).family in TRITON_FAMILIES])
def test_triton_paths_packed(name, monkeypatch):
    """The packed training forward with the ops' Triton paths (as on CUDA; the interpreter here): no graph break
    (``fullgraph=True``; their backward rules are custom ops, no ``autograd.Function`` for dynamo to speculate),
    compiled forward + backward equal eager."""
    monkeypatch.setattr(dispatch, "triton_available", lambda device: True)
    model = _model(name, narrow=True)
    _compiled_equals_eager(model, True, f"{name} packed triton compiled")
