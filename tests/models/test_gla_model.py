"""Family ``gla`` (seed ``gated-linear-attention-zh.txt`` §4.4) as a model: the state's documented shape, SwiGLU
blocks without positions, seed sizes, model-level validation.  The layer against the seed's recurrence:
``tests/layers/test_gla_layer.py``; what every family passes: ``test_every_family.py``.

(The file is not called ``test_gla.py``: that basename is taken by ``tests/ops/``.)"""

import pytest
import torch
import torch.nn.functional as F
from model_helpers import CausalLM, model, state_numel

from lintime.models import get_preset
from lintime.models.families.gla import GLAConfig
from tolerances import assert_exact

D64 = torch.float64


def test_state_is_the_documented_one():
    """Per layer and sequence one ``[H, K, V]`` matrix (K = d / 2 / H, V = d / H)."""
    m = model("gla-tiny")
    c = m.config
    H = c.mixer.n_heads
    K, V = c.d_model // 2 // H, c.d_model // H
    with torch.no_grad():
        _, st = m(torch.randint(0, 256, (2, 3)), return_state=True)
    assert isinstance(st.layers[0], torch.Tensor) and st.layers[0].shape == (2, H, K, V)
    assert state_numel(st) == c.n_layers * 2 * H * K * V


def test_blocks_are_swiglu_rmsnorm_no_positions():
    cfg = get_preset("gla-340m")
    f = cfg.ffn
    assert (f.kind, f.activation, f.value_activation, f.bias, f.hidden) == ("glu", "silu", "identity", False, 2816)
    assert (cfg.norm, cfg.position, cfg.vocab_size) == ("rmsnorm", "none", 32000)  # Mistral tokenizer
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads) == (1024, 24, 4)
    m = model("gla-tiny")
    blk = m.backbone.blocks[0]
    x = torch.randn(1, 3, m.config.d_model, dtype=D64)
    up_u, up_v = blk.ffn.up(x).split(blk.ffn.hidden, -1)
    assert_exact("SwiGLU", blk.ffn.down(F.silu(up_u) * up_v), blk.ffn(x))


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="expand_k \\* d_model = 32 must be an integer divisible by n_heads=3"):
        get_preset("gla-tiny", mixer=GLAConfig(n_heads=3))
    with pytest.raises(ValueError, match="expand_v \\* d_model = 6.4 must be an integer"):
        get_preset("gla-tiny", mixer=GLAConfig(expand_v=0.1))
    m = CausalLM(get_preset("gla-tiny"))
    with pytest.raises(TypeError, match="the state is the op's"):
        m.backbone.blocks[0].mixer(torch.randn(1, 2, 64), (1, 2), positions=torch.zeros(1, 2, dtype=torch.long))
