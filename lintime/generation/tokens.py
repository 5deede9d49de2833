"""Token-level generation through the static state: prompts as token ids in, drawn ids out.

    new = generate_tokens(model, [[1, 5, 9], [1, 7]], 32, eos_ids=(2,), graph=True)   # [[...], [...]]

The ``static`` / ``graph`` path of :func:`lintime.generation.generate` without text (no
tokenizer, no stop strings): prefill the prompts (packed, any lengths), replicate each prompt's
state ``repeats`` times, copy it into a :class:`~lintime.generation.static.StaticDecoder` at a
capacity of the longest prompt + ``max_new_tokens``, and run a
:class:`~lintime.generation.graphs.DecodeLoop` -- one CUDA graph replay per token when ``graph``
(on CUDA), the same step eagerly otherwise.  The host reads the drawn tokens after 1, 2, 4, ... up
to ``sync_every`` replays; a row ends at its first token in ``eos_ids`` (which it keeps); once at
most half of the batch still runs, the running rows move to a smaller loop (own buffers, captured
anew).  The HF ``generate`` of :mod:`lintime.hf` decodes through this.

Sampling as :func:`~lintime.generation.sampling.sample_seeded`: row ``r`` (sample ``j`` of prompt
``p``, ``r = p * repeats + j``) draws from a hash of ``(seed + r, step)``; ``temperature = 0`` is
greedy.  Notation: ``N`` prompts, ``R = N * repeats`` rows, ``M`` = ``max_new_tokens``.
"""

from __future__ import annotations

import time

import torch

from lintime.generation.decode import prefill
from lintime.generation.graphs import build_loop, token_blocks
from lintime.generation.static import StaticDecoder


@torch.no_grad()
def generate_tokens(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    repeats: int = 1,
    eos_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    graph: bool = True,
    prefill_chunk: int = 0,
    sync_every: int = 16,
    stats: dict | None = None,
) -> list[list[int]]:
    """Draw up to ``max_new_tokens`` tokens for each of the ``R`` rows; return them per row
    (prompt-major), each list ending at its first ``eos_ids`` token or after ``M`` tokens.

    ``graph``: capture the step in a CUDA graph when the model is on CUDA (a capture failure warns
    once and runs the same loop eagerly).  ``stats``, when given, is filled with
    ``decode_path`` (``graph`` or ``static``), ``prompt_tokens``, ``new_tokens``, ``prefill_s``
    and ``decode_s``.
    """
    from lintime.generation.loop import _check_length

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_tokens needs at least one prompt, each of at least one token")
    if max_new_tokens < 0 or repeats < 1 or sync_every < 1:
        raise ValueError(f"need max_new_tokens >= 0, repeats >= 1, sync_every >= 1; got "
                         f"{max_new_tokens}, {repeats}, {sync_every}")
    device = next(model.parameters()).device
    lens = [len(p) for p in prompts]
    _check_length(model, max(lens) + max_new_tokens)
    info = stats if stats is not None else {}
    R, M = len(prompts) * repeats, max_new_tokens
    out: list[list[int]] = [[] for _ in range(R)]
    was_training = model.training
    model.eval()
    try:
        t0 = time.perf_counter()
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)[None]  # [1, sum lens]
        cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)  # [N + 1]
        logits, state = prefill(model, ids, None, prefill_chunk, cu_seqlens=cu)  # [N, V]
        info.update(prompt_tokens=sum(lens), new_tokens=0, prefill_s=time.perf_counter() - t0, decode_s=0.0)
        if M == 0:
            info["decode_path"] = "static"
            return out
        t0 = time.perf_counter()
        if repeats > 1:
            replicate = torch.arange(len(prompts), device=device).repeat_interleave(repeats)  # [R]
            logits, state = logits.index_select(0, replicate), state.select(replicate)
        dec = StaticDecoder(model, state, max(lens) + M)
        del state
        seeds = seed + torch.arange(R, device=device)
        loop = build_loop(dec, logits, seeds, M, graph=graph and device.type == "cuda",
                          temperature=temperature, top_k=top_k, top_p=top_p)
        info["decode_path"] = "graph" if loop.graph is not None else "static"
        eos = set(eos_ids)
        live = list(range(R))
        for _, block in token_blocks(loop, M, sync_every, live):
            still = []
            for r in live:
                for tok in block[r]:
                    out[r].append(tok)
                    if tok in eos:
                        break
                else:
                    still.append(r)
            live[:] = still
        info["new_tokens"] = sum(len(o) for o in out)
        info["decode_s"] = time.perf_counter() - t0
        return out
    finally:
        model.train(was_training)


__all__ = ["generate_tokens"]
