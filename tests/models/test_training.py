"""The tiny presets learn: 60 AdamW steps overfit a small fixed batch (loss from ~ln 256 to < 10%)."""

import pytest
import torch
import torch.nn.functional as F

from lintime.models import CausalLM, MaskedLM, get_preset


def _fit(model, ids, loss_fn, steps, lr=3e-3):
    opt = torch.optim.AdamW(model.param_groups(0.01), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", ["transformer-tiny", "transformer-p-tiny", "transformer-pp-tiny"])
def test_causal_tiny_overfits(name):
    torch.manual_seed(0)
    model = CausalLM(get_preset(name))
    ids = torch.randint(0, 256, (4, 33))
    losses = _fit(model, ids, _lm_loss, steps=60)
    assert losses[0] > 5.0  # ~ln(256) at init
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_masked_tiny_overfits():
    torch.manual_seed(0)
    model = MaskedLM(get_preset("transformer-pp-tiny"))
    ids = torch.randint(1, 256, (4, 32))
    mask = torch.rand(ids.shape) < 0.25
    inputs = ids.masked_fill(mask, 0)  # token 0 is the [MASK] of this test

    def loss_fn(model, _):
        logits = model(inputs)
        return F.cross_entropy(logits[mask], ids[mask])

    losses = _fit(model, ids, loss_fn, steps=60)
    assert losses[-1] < 0.1 * losses[0], losses[::10]
