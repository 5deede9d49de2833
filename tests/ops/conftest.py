import pytest
import torch


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every ops test runs with NaN-poisoned fresh allocations."""
    yield


@pytest.fixture
def impl_calls(monkeypatch):
    """``impl_calls(family_module, backend)``: wrap that family's registered implementation so every
    call is counted; returns the list the calls are appended to (the dispatch tests assert on it)."""

    def spy(module, backend):
        calls = []
        impl = module._IMPLS[backend]
        monkeypatch.setitem(module._IMPLS, backend, lambda *a, **kw: calls.append(1) or impl(*a, **kw))
        return calls

    return spy


@pytest.fixture
def norm_wrapping_rows():
    """``rows(D) -> (BM, N)`` under the norm kernels' current launch: rows per tile ``BM`` of a long call of width
    ``D``, and a row count past twice the most programs x ``BM`` that is no multiple of ``BM`` (every program walks
    several tiles, the last tile partly past the rows: its tail masked)."""
    from lintime.ops.norm.triton import ops

    def rows(D):
        _, BM, warps, _ = ops.tiling(1 << 20, D)
        G = ops.max_programs(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"), warps)
        N = 2 * G * BM + BM // 2 + 1
        assert ops.tiling(N, D)[1] == BM and N > G * BM and (BM == 1 or N % BM)
        return BM, N

    return rows


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
