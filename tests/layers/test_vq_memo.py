"""VQAttention keeps the tensors a decoding step would rebuild every token (the relative table r, the codebook and
its squared norms, the scaled XL biases) between calls in eval mode without a gradient -- and only while they
cannot change: an in-place change of a parameter or codebook buffer, training mode or a gradient to carry
recomputes them.  And the straight-through and commitment-loss functions of the layer."""

import torch

from lintime.layers.vq import VQAttention


def _layer():
    torch.manual_seed(0)
    layer = VQAttention(16, key_dim=6, value_dim=24, n_codes=5, block_len=4, sin_base=50.0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer.eval()


def _fresh(layer, x, pos):
    layer._memos.clear()
    with torch.no_grad():
        return layer(x, positions=pos)[0]


def test_kept_between_calls_and_recomputed_on_change():
    layer = _layer()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        q = layer.project(x)[0]
        assert layer.xl_terms(q)[1] is layer.xl_terms(q)[1]  # kept
        y0 = layer(x, positions=pos)[0]
        for change in (lambda: layer.r_proj.weight.mul_(1.5), lambda: layer.codebook_sum.mul_(-1.0),
                       lambda: layer.codebook_count.add_(2.0), lambda: layer.xl_u.add_(0.3),
                       lambda: layer.xl_v.add_(0.3)):
            change()
            y = layer(x, positions=pos)[0]
            assert not torch.equal(y, y0)
            assert torch.equal(y, _fresh(layer, x, pos))
            y0 = y


def test_not_kept_with_a_gradient_or_in_training():
    layer = _layer()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        layer(x, positions=pos)  # fills the memos
    y = layer(x, positions=pos)[0]  # eval, gradient enabled: computed, differentiable
    y.sum().backward()
    for p in (layer.r_proj.weight, layer.xl_u, layer.xl_v):
        assert p.grad is not None and p.grad.abs().sum() > 0
    layer.train()
    before = layer.codebook_sum.clone()
    with torch.no_grad():
        layer(x, positions=pos)  # training mode: the EMA update moves the codebook
        layer.eval()
        assert not torch.equal(before, layer.codebook_sum)
        assert torch.equal(layer(x, positions=pos)[0], _fresh(layer, x, pos))


def test_straight_through_and_commit_functions_under_autocast():
    """The straight-through value is the codeword in k's dtype with the identity gradient; the commitment loss
    of bf16 keys is formed in fp32 (its value and gradient against the fp64 formula of seed Eq. 37)."""
    g = torch.Generator().manual_seed(4)
    k64 = torch.randn(2, 5, 2, 6, generator=g, dtype=torch.float64)
    c_z = torch.randn(2, 5, 2, 6, generator=g)  # fp32 codewords
    k = k64.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = VQAttention.commit_loss(k, c_z)
    assert loss.dtype == torch.float32
    kd = k.detach().double()
    want = (kd - c_z.double()).pow(2).sum((-2, -1)).mean()
    assert torch.allclose(loss.double(), want, rtol=1e-6)
    (dk,) = torch.autograd.grad(loss, k)
    assert dk.dtype == torch.bfloat16
    assert torch.allclose(dk.double(), (2 * (kd - c_z.double()) / 10).bfloat16().double(), rtol=1e-2, atol=1e-6)
    # straight-through: value exactly the codeword (in k's dtype), gradient the identity
    layer = _layer()
    kk = torch.randn(1, 4, 1, 6, dtype=torch.float64, requires_grad=True)
    codes, k_hat, cz = layer.quantize(kk, layer.codebook())
    assert torch.equal(k_hat.detach(), cz) and k_hat.grad_fn is not None
    (d,) = torch.autograd.grad((k_hat * 3.0).sum(), kk)
    assert torch.equal(d, torch.full_like(kk, 3.0))


def test_no_gradient_path_equals_the_training_formula():
    """Without a gradient the q / k scale is the norm's scalar gain (one kernel per norm): the same layer output
    as with a gradient (fp64 exact rule), states included."""
    from tolerances import assert_exact

    layer = _layer()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    st = layer.init_state(2, "cpu", torch.float64)
    y_grad, s_grad = layer(x, st, positions=pos)
    with torch.no_grad():
        y, s = layer(x, layer.init_state(2, "cpu", torch.float64), positions=pos)
    assert_exact("y", y_grad.detach(), y)
    assert_exact("cache_mean", s_grad.vq.cache_mean.detach(), s.vq.cache_mean)
    assert torch.equal(s_grad.vq.codes, s.vq.codes)
