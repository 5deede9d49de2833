"""The two model calls of decoding (as gpt-fast's ``generate.py`` splits them): :func:`prefill` runs the
prompt through the decoding state, :func:`decode_one_token` feeds one token per sequence.

Both are small pure functions over ``(model, tokens, state)`` that return ``(logits, new_state)``
and never modify the state they were given (model states are values; a *static* state,
:mod:`lintime.generation.static`, is the exception: its caches are written in place), so they can
be wrapped in ``torch.compile`` from outside (:func:`compiled_decode_one_token`).

Notation: ``B`` sequences decoded together, ``T`` prompt tokens, ``C`` prefill chunk, ``V``
vocabulary.  Memory: the model state is all that is carried from one call to the next; for the
linear-time families (FLASH, linear attention, GLA, VQ, ...) its size does not grow with the
number of tokens consumed, for softmax attention it is a KV cache that grows by one entry per
token.  Chunked prefill bounds the *activation* memory of the prompt to ``C`` tokens per call.
"""

from __future__ import annotations

from itertools import pairwise

import torch


# whole prompts in one model call up to this many tokens (all rows): an eager call is mostly fixed host work, as
# long for one token as for thousands, so fewer calls are faster; the bound caps one call's activation memory
PREFILL_TOKENS = 32768


def prefill_piece(rows: int, tokens: int) -> int:
    """Tokens per prompt per model call of the automatic prefill: all ``tokens`` when ``rows *
    tokens <= PREFILL_TOKENS``, else the largest power of two ``<= PREFILL_TOKENS // rows`` (so a
    piece ends on a multiple of every mixer's chunk size up to it: the next piece starts without a
    partial chunk, which the fused mixed chunk kernels would otherwise prepend to it)."""
    if rows * tokens <= PREFILL_TOKENS:
        return max(tokens, 1)
    return 1 << max(PREFILL_TOKENS // max(rows, 1), 1).bit_length() - 1


def prefill(
    model,
    ids: torch.Tensor,
    state=None,
    chunk_size: int | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
):
    """Run prompts through the decoding state; return ``(logits [N, V], state)``.

    ``ids``: ``[B, T]`` (``N = B`` prompts of equal length) or, with ``cu_seqlens`` (``[N + 1]``,
    FlashAttention convention), ``[1, T]`` holding ``N`` prompts of any lengths back to back.
    ``state``: the state to continue (``None``: an empty one).  ``chunk_size``: feed at most
    ``C`` tokens *per prompt* per model call; ``None`` / ``0``: automatic (:func:`prefill_piece`:
    the whole prompt in one call up to ``PREFILL_TOKENS`` tokens per call).  The result is the
    same for every ``C`` (the models' "any split point" contract), only memory and speed change.
    Each call is the model's full-sequence (training) path with a state; only the last token of
    each prompt goes through the output projection.  Returned logits are those of each prompt's
    last token (what the first new token is drawn from); every prompt must have at least one token.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
    if chunk_size is not None and chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 or None: automatic, prefill_piece), got {chunk_size}")
    if cu_seqlens is None:
        return _prefill_rows(model, ids, state, chunk_size or 0)
    return _prefill_packed(model, ids, state, chunk_size or 0, cu_seqlens)


def _empty_state(model, N: int, device):
    """A fresh state, its tensors marked as checked: the ops then skip their value checks (host reads) on it."""
    from lintime.layers.base import map_state
    from lintime.ops.utils import mark_checked

    state = model.init_state(N, device=device)
    map_state(state, lambda t: mark_checked(t) or t)
    return state


def _step(model, ids, state, cu_seqlens=None):
    """One model call with a state: ``(features [B, T, *], new state)`` and the map from the
    features of the prompts' last tokens to their logits.  A lintime ``CausalLM`` returns its
    hidden states (after the final norm) and leaves the output projection to the last tokens: a
    ``[T, V]`` logits matrix per call is the largest tensor of a long prefill.  Any other causal LM
    (same call signature) returns its logits."""
    from lintime.models import CausalLM

    if isinstance(model, CausalLM):
        h, state = model.backbone(ids, state, cu_seqlens=cu_seqlens)
        return h, state, model._logits
    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    out, state = model(ids, state, return_state=True, **packed)
    return out, state, lambda x: x


def _prefill_rows(model, ids, state, C):
    B, T = ids.shape
    if T == 0:
        raise ValueError("prefill needs at least one token per prompt")
    if state is None:
        state = _empty_state(model, B, ids.device)
    C = C or prefill_piece(B, T)
    for start in range(0, T, C):
        h, state, head = _step(model, ids[:, start : start + C], state)  # [B, c, *]
    return head(h[:, -1]), state  # [B, V]


def _prefill_packed(model, ids, state, C, cu_seqlens):
    if ids.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the prompts must be packed into one row (B == 1), got B={ids.shape[0]}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != ids.shape[1] or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={ids.shape[1]}, got {cu}")
    lens = [b - a for a, b in pairwise(cu)]
    N = len(lens)
    if min(lens) == 0:
        raise ValueError("prefill needs at least one token per prompt (cu_seqlens has an empty sequence)")
    if len(set(lens)) == 1:  # equal lengths (one prompt, or samples of one): rows, no packing to lay out
        return _prefill_rows(model, ids.view(N, lens[0]), state, C)
    if state is None:
        state = _empty_state(model, N, ids.device)
    C = C or prefill_piece(N, max(lens))
    flat = ids[0]
    last: list[torch.Tensor | None] = [None] * N  # each prompt's last features
    for start in range(0, max(lens), C):
        # chunk: tokens [start, start + C) of every prompt, packed; a prompt already consumed
        # contributes an empty sequence (its state row passes through unchanged)
        pieces, bounds, ends = [], [0], []
        for n in range(N):
            a = min(cu[n] + start, cu[n + 1])
            b = min(a + C, cu[n + 1])
            pieces.append(flat[a:b])
            bounds.append(bounds[-1] + (b - a))
            ends.append(b == cu[n + 1] and b > a)
        chunk_cu = torch.tensor(bounds, dtype=torch.int32, device=ids.device)
        h, state, head = _step(model, torch.cat(pieces)[None], state, chunk_cu)  # [1, t, *]
        for n in range(N):
            if ends[n]:
                last[n] = h[0, bounds[n + 1] - 1].clone()  # not a view: h goes with the piece
    return head(torch.stack(last)), state  # [N, V]


def decode_one_token(model, token: torch.Tensor, state):
    """One decoding step: ``token`` ``[B]`` or ``[B, 1]`` (int64), ``state`` with ``B`` rows ->
    ``(logits [B, V], new_state)``."""
    out, state = model(token.reshape(-1, 1), state, return_state=True)  # [B, 1, V]
    return out[:, -1], state


def compiled_decode_one_token(**compile_kwargs):
    """:func:`decode_one_token` wrapped in ``torch.compile`` (``dynamic=True`` by default, so a
    batch that shrinks as samples finish does not recompile at every size)."""
    compile_kwargs.setdefault("dynamic", True)
    return torch.compile(decode_one_token, **compile_kwargs)


def state_nbytes(state) -> int:
    """Bytes held by the tensors of a decoding state (all rows); divide by ``state.batch_size``
    for one sequence.  Constant in the tokens consumed for the linear-time families, growing by
    one key/value entry per token and layer for softmax attention."""
    from lintime.layers.base import map_state

    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_state(state, add)
    return total
