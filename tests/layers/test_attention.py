"""Softmax attention (``lintime.layers.attention``): the KV-cache path equals the full path, states are values,
errors; ``KVCache.select`` / ``to``."""

import pytest
import torch

from lintime.layers import KVCache, Mixer, MultiHeadAttention, token_positions
from tolerances import assert_exact

D64 = torch.float64

@pytest.mark.parametrize("rope", [False, True])
def test_mha_state_path_equals_full_path(rope):
    mha = MultiHeadAttention(16, 4, rope=rope).double()
    assert isinstance(mha, Mixer)
    x = torch.randn(3, 11, 16, dtype=D64)
    pos = token_positions(3, 11)
    full, none_state = mha(x, positions=pos)
    assert none_state is None
    st = mha.init_state(3, "cpu", D64)
    y1, st = mha(x[:, :4], st, positions=pos[:, :4])
    y2, st2 = mha(x[:, 4:], st, positions=pos[:, 4:])
    assert_exact("mha cache", full, torch.cat([y1, y2], 1))
    assert st2.lengths.tolist() == [11, 11, 11] and st2.max_length == 11
    assert st.lengths.tolist() == [4, 4, 4]  # states are values: the old one is untouched
    y2b, _ = mha(x[:, 4:], st, positions=pos[:, 4:])
    assert_exact("mha reuse old state", y2, y2b)


def test_mha_errors():
    mha = MultiHeadAttention(16, 4, causal=False)
    with pytest.raises(ValueError, match="needs causal"):
        mha(torch.randn(1, 3, 16), mha.init_state(1, "cpu", torch.float32), positions=token_positions(1, 3))
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, 4)
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 3"):
        mha(torch.randn(3, 1, 16), mha.init_state(2, "cpu", torch.float32), positions=token_positions(3, 1))


def test_kvcache_select_and_to():
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 1, 4).contiguous()
    c = KVCache(k, -k, torch.tensor([2, 1, 2]), 2)
    s = c.select(torch.tensor([2, 0, 0, 1]))
    assert s.batch_size == 4 and s.max_length == 2
    assert s.k[:, 0, 0, 0].tolist() == [2.0, 0.0, 0.0, 1.0]
    assert s.v[:, 0, 0, 0].tolist() == [-2.0, 0.0, 0.0, -1.0]
    assert s.lengths.tolist() == [2, 2, 2, 1]
    assert c.to("cpu").k.device.type == "cpu"

