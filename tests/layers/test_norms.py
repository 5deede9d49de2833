"""Norms (``lintime.layers.norms``) against seed Code 5 and torch: LayerNorm, ScaleNorm, RMSNorm, half dtypes."""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers import LayerNorm, RMSNorm, ScaleNorm, build_norm
from tolerances import assert_exact

D64 = torch.float64

def test_layernorm_matches_torch():
    x = torch.randn(3, 5, 16, dtype=D64)
    n = LayerNorm(16).double()
    with torch.no_grad():
        n.weight.normal_()
        n.bias.normal_()
    assert_exact("layernorm", F.layer_norm(x, (16,), n.weight, n.bias, 1e-5), n(x))


def test_scalenorm_and_rmsnorm_formulas():
    x = torch.randn(4, 7, 12, dtype=D64)
    s = ScaleNorm(12).double()
    with torch.no_grad():
        s.scale.fill_(1.7)
    ref = 1.7 * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)  # seed Code 5, scale_norm
    assert_exact("scalenorm", ref, s(x))
    assert s.scale.shape == () and sum(p.numel() for p in s.parameters()) == 1
    r = RMSNorm(12).double()
    with torch.no_grad():
        r.weight.normal_()
    assert_exact("rmsnorm", r.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5), r(x))


def test_norms_keep_half_dtype_and_bad_name():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    for kind in ("layernorm", "scalenorm", "rmsnorm"):
        assert build_norm(kind, 8)(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        build_norm("batchnorm", 8)

