"""What the gau_heads tests share (tests/modules/heads/test_gau_heads.py, test_gau_heads_split.py): the inputs,
a run of one backend with its gradients, the shapes that cross the interpreter's tiles, and the markers."""

import pytest
import torch

from lintime.modules import gau_heads

CUDA = torch.cuda.is_available()
NAMES = ("u", "v", "heads", "dh", "dgamma", "dbeta", "dbias")


def heads_bias(h, seed=0):
    """A bias for ``h``'s columns, ``h``'s dtype and device (fp64 drawn, O(1): it moves silu's operating point)."""
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(h.shape[-1], generator=g, dtype=torch.float64).to(h.device, h.dtype)


def heads_inputs(B, T, e, s, nh, gating, dtype, *, seed=0, device="cpu", pmin=-300, pmax=100_000):
    """``h, gamma, beta, positions`` and the output gradients ``du, dv, dheads`` (fp64 drawn, then
    cast).  ``h`` has scale 2 (silu's curved part), gamma / beta O(1)."""
    g = torch.Generator().manual_seed(seed * 1009 + T * 31 + e * 7 + s)
    W = (2 * e if gating else e) + s
    f64 = {"generator": g, "dtype": torch.float64}
    h = 2 * torch.randn(B, T, W, **f64)
    gamma, beta = torch.randn(nh, s, **f64), torch.randn(nh, s, **f64)
    pos = torch.randint(pmin, pmax, (B, T), generator=g)
    du = torch.randn(B, T, e, **f64) if gating else None
    dv, dheads = torch.randn(B, T, e, **f64), torch.randn(B, T, nh, s, **f64)
    cast = lambda x: None if x is None else x.to(device, dtype)
    return cast(h), cast(gamma), cast(beta), pos.to(device), (cast(du), cast(dv), cast(dheads))


def run_heads(backend, h, gamma, beta, pos, grads, *, e, s, gating=True, rope_heads=1, split_heads=False, bias=None,
         **kw):
    """Outputs and the gradients of h, gamma, beta (and bias, when given) by name; an output whose gradient is
    ``None`` takes no part in the backward (its gradient is zero); a parameter no gradient reaches gets
    zeros.  With ``split_heads`` the heads' gradient ``grads[2]`` is a list of one per head."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, gamma, beta, *(() if bias is None else (bias,)))]
    u, v, heads = gau_heads(*leaves[:3], pos, e=e, s=s, gating=gating, rope_heads=rope_heads,
                            split_heads=split_heads, bias=None if bias is None else leaves[3], backend=backend, **kw)
    qs, dqs = (heads, grads[2]) if split_heads else ((heads,), (grads[2],))
    outs = [(o, g) for o, g in zip((u, v, *qs), (*grads[:2], *dqs)) if o is not None and g is not None]
    got = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs], allow_unused=True)
    got = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, got)]
    return {k: x for k, x in zip(NAMES, (u, v, heads, *got)) if x is not None}


# (T, e, s, nh, gating, rope_heads): T = 1 / 7 / 37 rows (not multiples of 8); e = 20 or 5 (two
# 16-wide tiles with a partial one, one partial tile); s = 12 with one RoPE group (6 half-columns in an
# 8-wide tile) or two (groups of 6: 3 + 3), s = 8 / 4 with two groups (groups of 4 / 2)
CASES = [
    (37, 20, 12, 4, True, 1),  # FLASH
    (37, 20, 12, 6, True, 1),  # FLASH, first-to-all
    (7, 5, 12, 2, True, 2),  # GAU, two attention heads
    (37, 20, 8, 2, False, 2),  # GAU without gating
    (1, 20, 4, 2, True, 2),
    (7, 5, 12, 2, False, 1),
]


def case_id(c):
    T, e, s, nh, gating, R = c
    return f"T{T}-e{e}-s{s}-nh{nh}-{'gate' if gating else 'nogate'}-R{R}"


cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests cover the compiled kernels")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
