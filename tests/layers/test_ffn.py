"""Feed-forward blocks (``lintime.layers.ffn``) against seed Eq. 1-2: MLP, GLU (GEGLU, SiLU / SiLU)."""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers import GLU, MLP
from tolerances import assert_exact

D64 = torch.float64

def test_mlp_and_glu_formulas():
    x = torch.randn(2, 5, 8, dtype=D64)
    mlp = MLP(8, 32).double()
    assert_exact("mlp", mlp.down(F.gelu(mlp.up(x))), mlp(x))
    glu = GLU(8, 6, activation_name="gelu").double()
    Wu, Wv = glu.up.weight[:6], glu.up.weight[6:]
    bu, bv = glu.up.bias[:6], glu.up.bias[6:]
    ref = glu.down(F.gelu(x @ Wu.T + bu) * (x @ Wv.T + bv))  # seed Eq. 1-2, GEGLU
    assert_exact("glu", ref, glu(x))
    swi = GLU(8, 6, activation_name="silu", value_activation="silu").double()
    u, v = swi.up(x).split(6, -1)
    assert_exact("glu silu/silu", swi.down(F.silu(u) * F.silu(v)), swi(x))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        MLP(8, 16, activation_name="swish")

