import pytest
import torch


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every ops test runs with NaN-poisoned fresh allocations."""
    yield


@pytest.fixture
def eager_and_static_decode():
    """``run(model, ids, steps) -> (eager_tokens, eager_logits, static_tokens, static_logits, decoder)``: greedy
    decoding of ``ids`` ``[B, T]`` for ``steps`` tokens, eagerly (``decode_one_token``, a new state per token) and
    through ``StaticDecoder`` with every mixer's ``backend = "triton"`` (the fused one-token step; through the
    interpreter on the CPU).  The static path's first step is taken by hand: the model must return the static
    state it was given, updated in place.  Call it under the caller's ``no_grad`` / autocast."""
    from lintime.generation import StaticDecoder, decode_one_token, prefill
    from lintime.layers.base import copy_state_

    def set_backend(model, backend):
        for blk in model.backbone.blocks:
            blk.mixer.backend = backend

    def run(model, ids, steps):
        logits, state = prefill(model, ids)
        tok, st, eager, eager_logits = logits.argmax(-1), state, [], []
        for _ in range(steps):
            lg, st = decode_one_token(model, tok, st)
            tok = lg.argmax(-1)
            eager.append(tok)
            eager_logits.append(lg)
        dec = StaticDecoder(model, state, capacity=ids.shape[1] + steps)
        assert all(s.static for s in dec.state.layers)
        set_backend(model, "triton")
        try:
            tok, static, static_logits = logits.argmax(-1), [], []
            for t in range(steps):
                if t == 0:  # what StaticDecoder.step does, with a look at the state the model returns
                    lg, new = decode_one_token(model, tok, dec.state)
                    assert all(a is b for a, b in zip(new.layers, dec.state.layers))  # in place, returned as is
                    copy_state_(dec.state, new)
                else:
                    lg = dec.step(tok)
                tok = lg.argmax(-1)
                static.append(tok)
                static_logits.append(lg)
        finally:
            set_backend(model, None)
        return torch.stack(eager, 1), torch.stack(eager_logits), torch.stack(static, 1), torch.stack(static_logits), dec

    return run
