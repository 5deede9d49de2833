"""``load_model`` builds the model without drawing its initial weights (``build_model(initialise=False)``) and the
load replaces every parameter: the loaded model equals the saved one, for every family (its state and its outputs:
a buffer built from a skipped init would show there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lintime.models import CausalLM, MaskedLM, get_preset
from lintime.training import checkpoint as ckpt
from lintime.training import load_model
from tiny_presets import FAMILY_TINY_PRESETS, saved_run


def _saved(tmp_path, name: str, objective: str = "clm"):
    torch.manual_seed(0)
    cfg = get_preset(name, vocab_size=260)
    model = (CausalLM if objective == "clm" else MaskedLM)(cfg).eval()
    with torch.no_grad():  # every parameter away from its init, so an unloaded one cannot pass for loaded
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return saved_run(tmp_path / "run", model, objective=objective), model


@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_loaded_model_equals_the_saved_one(tmp_path, name):
    run, model = _saved(tmp_path, name)
    loaded = load_model(run).model
    want = model.state_dict()
    got = loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    ids = torch.randint(0, 260, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_masked_model_too(tmp_path):
    run, model = _saved(tmp_path, "transformer-pp-tiny", "mlm")
    loaded = load_model(run).model
    ids = torch.randint(0, 260, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_the_build_draws_nothing_and_restores_init():
    before = {n: getattr(nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "zeros_")}
    config = {"model": get_preset("transformer-pp-tiny", vocab_size=260).to_dict(), "objective": "clm"}
    torch.manual_seed(0)
    ckpt.build_model(config, initialise=False)
    after_skipped = torch.randn(4)
    torch.manual_seed(0)
    after_nothing = torch.randn(4)
    assert torch.equal(after_skipped, after_nothing)  # no random draw while building
    assert {n: getattr(nn.init, n) for n in before} == before
    torch.manual_seed(0)
    ckpt.build_model(config)
    assert not torch.equal(torch.randn(4), after_nothing)  # the ordinary build draws its weights
