"""A minimal sampler for the end-of-training sample.

``lintime.generation`` (owned by the generate command) is the full sampler (nucleus, batching,
compiled steps); this is the few lines ``lintime train`` needs to show what the model learnt:
prefill the prompt once, then decode one token at a time from the model's constant-size state.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    *,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns the generated text only.

    ``temperature`` 0 is greedy; ``top_k`` > 0 keeps the ``k`` most likely tokens.  The prompt is
    preceded by ``bos`` (training wraps every document in ``bos`` / ``eos``); generation stops
    at ``eos``.  Deterministic for a given ``seed``.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)], dtype=torch.long, device=device)
    logits, state = model(ids, return_state=True)  # prefill: [1, P, V]
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = _pick(logits[0, -1].float(), temperature, top_k, gen)
        if nxt == tokenizer.eos_id:
            break
        out.append(nxt)
        logits, state = model(torch.tensor([[nxt]], device=device), state, return_state=True)
    model.train(was_training)
    return tokenizer.decode(out)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
