"""TrainConfig.init_seed: the initial weights come from it alone; the data order from seed."""

from __future__ import annotations

import pytest
import torch

from lintime.training import TrainConfig, load_model, train


def _first_weights_and_loss(tiny_config, tmp_path, name, **kw):
    res = train(tiny_config(steps=1, sample_tokens=0, lr=1e-12, **kw), out=tmp_path, name=name, progress=False,
                echo=None)
    return load_model(res.run_dir).model.state_dict(), res.first_loss


def test_init_seed_draws_the_weights_and_seed_the_data(tiny_config, tmp_path):
    base, loss = _first_weights_and_loss(tiny_config, tmp_path, "a", seed=0)
    same_init, loss_other_data = _first_weights_and_loss(tiny_config, tmp_path, "b", seed=1, init_seed=0)
    other_init, loss_same_data = _first_weights_and_loss(tiny_config, tmp_path, "c", seed=0, init_seed=5)
    # lr ~ 0: the saved weights are the initial ones
    assert all(torch.allclose(base[k], same_init[k]) for k in base)
    assert any(not torch.allclose(base[k], other_init[k]) for k in base)
    assert loss_other_data != loss  # seed 1: another batch for the same weights
    assert loss_same_data != loss  # init 5: other weights on the same batch


def test_init_seed_is_validated():
    with pytest.raises(ValueError, match="init_seed must be an integer >= 0"):
        TrainConfig(init_seed=-1)
