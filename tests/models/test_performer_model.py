"""Family ``performer`` (FLASH seed baseline: Performer, ReLU kernel, RoPE) as a model: the state's documented size,
Tables 8-9 shapes, model-level validation.  The layer against the kernel formula and its random features:
``tests/layers/test_performer.py``; what every family passes: ``test_every_family.py``."""

import pytest
import torch
from model_helpers import meta_params_m, model, state_numel

from lintime.models import get_preset
from lintime.models.families.performer import PerformerConfig


def test_state_is_the_documented_one():
    """Per layer and sequence: ``kv [H, M, D]`` over the ``M`` features and the normaliser ``k_sum [H, M]``."""
    m = model("performer-tiny")
    c = m.config
    M, H = c.mixer.num_features, c.mixer.n_heads
    D = c.d_model // H
    with torch.no_grad():
        _, state = m(torch.randint(0, 256, (2, 10)), return_state=True)
    assert state_numel(state) == c.n_layers * 2 * H * (M * D + M)


def test_seed_table_shapes():
    """Tables 8-9: Performer 110M (d=768, 12+12 layers; the counts: ``test_presets.py``).  Table 10 has no
    Performer row: ``performer-large`` takes Transformer+'s large shape, whose parameters it has exactly (the
    random features are a buffer)."""
    assert meta_params_m("performer-base") == meta_params_m("transformer-p-base")
    assert meta_params_m("performer-large") == meta_params_m("transformer-p-large")
    cfg, mlm = get_preset("performer-base"), get_preset("performer-base-mlm")
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads, cfg.ffn.kind, cfg.ffn.activation) == (768, 12, 12, "mlp", "gelu")
    assert (cfg.position, cfg.mixer.rope, cfg.norm, mlm.norm) == ("scaled_sin", True, "layernorm", "scalenorm")


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_heads=3"):
        get_preset("performer-tiny", mixer=PerformerConfig(n_heads=3))
    with pytest.raises(ValueError, match="RoPE needs an even head size, got 9"):
        get_preset("performer-tiny", mixer=PerformerConfig(n_heads=4, head_dim=9))
