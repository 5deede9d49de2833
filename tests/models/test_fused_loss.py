"""The models' loss with targets: the fused linear + cross-entropy (``fused_loss=True``, the default)
equals the plain loss on the full logits -- the summed loss and every parameter's gradient -- for a
tied and an untied output projection, packed sequences and ignored targets; fp32 on the CPU, and
bf16 autocast by the half-precision rule."""

import pytest
import torch
import torch.nn.functional as F

from lintime.models import CausalLM, MaskedLM, get_preset
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_exact, rel_rms


def _batch(V, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, 29), generator=g)
    targets = torch.randint(0, V, (1, 29), generator=g)
    targets[0, [4, 11, 28]] = -100  # sequence ends and a padded position predict nothing
    cu = torch.tensor([0, 5, 12, 29], dtype=torch.int32)
    return ids, targets, cu


def _loss_and_grads(model, ids, targets, cu, fused, autocast=None):
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, cu_seqlens=cu, targets=targets, fused_loss=fused)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, cls", [("transformer-pp-tiny", CausalLM), ("flash-tiny", CausalLM),
                                       ("transformer-pp-tiny", MaskedLM)])
@pytest.mark.parametrize("tie", [True, False])
def test_fused_loss_equals_the_plain_loss_fp32(name, cls, tie):
    torch.manual_seed(0)
    model = cls(get_preset(name, vocab_size=300, tie_embeddings=tie))
    ids, targets, cu = _batch(300)
    loss_p, grads_p = _loss_and_grads(model, ids, targets, cu, fused=False)
    loss_f, grads_f = _loss_and_grads(model, ids, targets, cu, fused=True)
    assert loss_f.dtype == torch.float32 and loss_f.shape == ()
    assert_exact("loss", loss_p, loss_f)
    assert grads_p.keys() == grads_f.keys() and len(grads_p) > 3
    for n in grads_p:
        assert_exact(n, grads_p[n], grads_f[n])
    # the plain path is the summed cross-entropy of the model's logits
    logits = model(ids, cu_seqlens=cu)
    ref = F.cross_entropy(logits[0], targets[0], ignore_index=-100, reduction="sum")
    assert_exact("plain = F.cross_entropy(logits)", ref.detach(), loss_p)


def test_fused_loss_under_bf16_autocast():
    """Against the fp64 model: the fused loss's error is within 2 x the plain bf16 loss's + floor."""
    torch.manual_seed(0)
    model = CausalLM(get_preset("transformer-pp-tiny", vocab_size=300))
    ids, targets, cu = _batch(300, seed=1)
    loss_b, grads_b = _loss_and_grads(model, ids, targets, cu, fused=False, autocast=torch.bfloat16)
    loss_f, grads_f = _loss_and_grads(model, ids, targets, cu, fused=True, autocast=torch.bfloat16)
    model64 = model.double()
    loss_r, grads_r = _loss_and_grads(model64, ids, targets, cu, fused=False)
    assert loss_f.dtype == torch.float32
    for n, r, b, f in [("loss", loss_r, loss_b, loss_f)] + [(n, grads_r[n], grads_b[n], grads_f[n]) for n in grads_r]:
        e_f, e_b = rel_rms(r, f), rel_rms(r, b)
        assert e_f <= HALF_FACTOR * e_b + HALF_FLOOR[torch.bfloat16], f"{n}: {e_f:.2e} vs plain bf16 {e_b:.2e}"


def test_targets_shape_is_checked():
    model = CausalLM(get_preset("transformer-pp-tiny", vocab_size=300))
    ids, targets, cu = _batch(300)
    with pytest.raises(ValueError, match="targets"):
        model(ids, cu_seqlens=cu, targets=targets[0])
