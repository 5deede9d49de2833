"""The mixer protocol (``lintime.layers.base``): the state helpers select rows of any batch-first state, and
``lintime.layers`` exports every mixer and state class, one of which every family builds."""

import dataclasses
import importlib
import inspect
import pkgutil

import torch
from tiny_presets import FAMILY_TINY_PRESETS

import lintime.layers as layers
from lintime.layers import BatchState, Mixer, select_state, state_to
from lintime.models import CausalLM, get_preset

@dataclasses.dataclass
class _OpLikeState:  # like the ops' MixedChunkState: batch-first tensors, no methods
    kv: torch.Tensor
    fill: torch.Tensor


@dataclasses.dataclass
class _LayerState(BatchState):
    op: _OpLikeState
    extra: list
    chunk: int = 7


def test_state_helpers_select_any_batch_first_state():
    idx = torch.tensor([1, 1, 0])
    t = torch.arange(6.0).view(2, 3)
    assert torch.equal(select_state(t, idx), t[idx])  # a bare [N, ...] tensor (linear attention / GLA)
    op = _OpLikeState(torch.arange(2.0).view(2, 1, 1), torch.tensor([3, 4]))
    assert select_state(op, idx).fill.tolist() == [4, 4, 3]  # a plain dataclass
    st = _LayerState(op, [torch.tensor([10, 20])])
    s = st.select(idx)
    assert s.op.fill.tolist() == [4, 4, 3] and s.extra[0].tolist() == [20, 20, 10] and s.chunk == 7
    assert s.batch_size == 3 and st.batch_size == 2
    assert select_state(None, idx) is None and state_to(st, "cpu").op.kv.device.type == "cpu"




def test_lintime_layers_exports_every_mixer_and_state():
    """Every Mixer and BatchState class defined under lintime/layers is exported by lintime.layers,
    and every registered family (one tiny preset each, ``tests/tiny_presets.py``) builds one of them
    (a new mixer cannot be left out)."""
    defined = set()
    for info in pkgutil.iter_modules(layers.__path__):
        mod = importlib.import_module(f"lintime.layers.{info.name}")
        for name, obj in inspect.getmembers(mod, inspect.isclass):
            if obj.__module__ == mod.__name__ and issubclass(obj, (Mixer, BatchState)) and not name.startswith("_"):
                defined.add(obj)
    exported = {getattr(layers, n) for n in layers.__all__}
    missing = sorted(c.__qualname__ for c in defined - exported)
    assert not missing, f"lintime.layers does not export {missing}"
    for name in FAMILY_TINY_PRESETS:
        model = CausalLM(get_preset(name, vocab_size=16, n_layers=1))
        assert type(model.backbone.blocks[0].mixer) in exported, name
