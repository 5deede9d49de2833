"""The training step with the fused linear + cross-entropy (the default) gives the plain loss's
numbers: the logged loss and every accumulated gradient, fp32 on the CPU, with accumulation over
micro-batches and for a masked LM."""

from __future__ import annotations

import pytest
import torch

from lintime.data import BatchIterator, ByteTokenizer, open_prepared
from lintime.models import CausalLM, MaskedLM, get_preset
from lintime.models import lm
from lintime.modules import linear_cross_entropy
from tolerances import assert_exact
from lintime.training.step import forward_backward


@pytest.mark.parametrize("cls, objective", [(CausalLM, "clm"), (MaskedLM, "mlm")])
@pytest.mark.parametrize("micro_rows", [4, 2])
def test_step_fused_equals_plain(token_cache, monkeypatch, cls, objective, micro_rows):
    ds = open_prepared(token_cache, "train")
    batch = next(BatchIterator(ds, batch_size=4, context_len=32, tokenizer=ByteTokenizer(), seed=3, objective=objective))
    torch.manual_seed(0)
    model = cls(get_preset("flash-tiny", vocab_size=260) if cls is CausalLM
                else get_preset("transformer-pp-tiny", vocab_size=260))
    calls = []
    monkeypatch.setattr(lm, "linear_cross_entropy", lambda *a, **kw: calls.append(1) or linear_cross_entropy(*a, **kw))
    out = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss, _ = forward_backward(model, batch, micro_rows=micro_rows, fused_loss=fused)
        assert len(calls) == (4 // micro_rows if fused else 0)  # one fused loss per micro-batch
        out[fused] = (loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (loss_p, grads_p), (loss_f, grads_f) = out[False], out[True]
    assert loss_f == pytest.approx(loss_p, rel=1e-6) and loss_p > 1.0
    assert grads_p.keys() == grads_f.keys() and len(grads_p) > 3
    for n in grads_p:
        assert_exact(n, grads_p[n], grads_f[n])
