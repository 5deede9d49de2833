"""Family ``softmax`` (the seed's Transformer baselines) as a model: the two variants besides Transformer++ (learned
positions + MLP; RoPE + MLP) pass the parallel == recurrent and packing checks and overfit a batch, and the
backbone's state and packing errors.  Transformer++ (``transformer-pp-tiny``) passes what every family passes in
``test_every_family.py``; the attention layer: ``tests/layers/test_attention.py``."""

import pytest
import torch
from model_helpers import (
    MaskedLM,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    model,
    overfit,
)

from lintime.models import get_preset

VARIANTS = ["transformer-tiny", "transformer-p-tiny"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", VARIANTS)
def test_full_sequence_equals_prefill_plus_decoding(name, dtype):
    check_prefill_plus_decoding(model(name, dtype), f"{name} {dtype}")


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked"])
@pytest.mark.parametrize("name", VARIANTS)
def test_packed_equals_separate(name, masked):
    check_packed_equals_separate(model(name, cls=MaskedLM) if masked else model(name), name)


@pytest.mark.parametrize("name", VARIANTS)
def test_packed_prefill_decoding_beams_and_continuation(name):
    check_packed_prefill_then_decoding(model(name), name, steps=3)


@pytest.mark.parametrize("name", VARIANTS)
def test_tiny_overfits(name):
    overfit(get_preset(name), steps=60)  # MLP blocks learn a little slower than GLU ones


def test_state_errors():
    m = model("transformer-tiny")
    mlm = model("transformer-tiny", cls=MaskedLM)
    ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(ValueError, match="bidirectional"):
        mlm(ids, return_state=True)
    with pytest.raises(ValueError, match="bidirectional"):
        mlm.init_state(2)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        m(torch.randint(0, 256, (1, 5)), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="packed into one row"):
        m(ids, cu_seqlens=torch.tensor([0, 5]))
    # learned positions: decoding past the table is a clear error
    _, state = m(torch.randint(0, 256, (1, 1023)), return_state=True)
    m(torch.randint(0, 256, (1, 1)), state)
    with pytest.raises(ValueError, match="beyond the learned position table"):
        m(torch.randint(0, 256, (1, 2)), state)
