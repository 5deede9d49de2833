"""Held-out language-model scores at several context lengths: bits per byte, perplexity.

What is scored
--------------
Each document ``d`` (``n`` tokens) is the sequence ``[bos] d [eos]``, as in training: ``n + 1``
targets (every token of ``d``, then ``eos``), each predicted from the tokens before it.  One
pass over the documents predicts **every target exactly once**.

Context length ``L``: a document's inputs are cut into consecutive windows of ``L`` tokens
aligned to the document's start (``[0, L)``, ``[L, 2L)``, ...); each window is a separate
sequence (rows are independent: no state is carried from one window to the next).  A token at
position ``p`` of its document is thus predicted from its last ``p mod L + 1`` tokens -- exactly
the context a model trained at ``L`` sees, and the same rule for every family, so softmax
transformers and linear-time models are scored on equal terms.  ``L`` above the training
context is *length extrapolation*.  (Carrying the state across windows would give the recurrent
families the whole document as context, i.e. another quantity: it is what
:func:`lintime.generation.prefill` computes.)

Windows are packed back to back into one row of at most ``batch_tokens`` tokens with
``cu_seqlens`` (a window never sees another), so short documents do not waste compute on padding.

Scores (every sum over the targets of the evaluated documents, ``eos`` included)::

    loss            = sum(-ln p(target)) / n_targets                       nats per token
    bits_per_token  = loss / ln 2
    perplexity      = exp(loss)                                            (per token)
    bits_per_byte   = sum(-ln p(target)) / ln 2 / n_bytes

``n_bytes`` counts the UTF-8 bytes of the evaluated documents' text.  ``bits_per_byte`` is the
code length of the text (its end included) per byte, comparable across tokenizers.  With the
byte tokenizer it is ``bits_per_token * n_targets / n_bytes``, slightly above the trainer's
``val_bpb`` (the mean per target), by the factor ``1 + n_docs / n_bytes``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class ContextResult:
    """Scores at one context length (``skipped``: why it was not evaluated, else ``None``)."""

    context_len: int
    loss: float = math.nan
    bits_per_token: float = math.nan
    bits_per_byte: float = math.nan
    perplexity: float = math.nan
    n_targets: int = 0
    n_windows: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    skipped: str | None = None


@dataclass
class EvalReport:
    """All context lengths over the same documents."""

    split: str
    n_docs: int
    n_bytes: int
    n_targets: int
    tokenizer: str
    results: list[ContextResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        for r in out["results"]:  # JSON has no NaN
            for k, v in r.items():
                if isinstance(v, float) and not math.isfinite(v):
                    r[k] = None
        return out


def select_documents(dataset, max_tokens: int | None) -> int:
    """How many documents (from the first, in split order) make up the evaluation: all of them,
    or with ``max_tokens`` the fewest whose targets reach ``max_tokens`` (whole documents only,
    so the byte count stays exact)."""
    n_docs = len(dataset)
    if max_tokens is None:
        return n_docs
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = np.asarray(dataset.doc_lengths if hasattr(dataset, "doc_lengths") else [len(dataset[i]) for i in range(n_docs)])
    reach = np.cumsum(lengths + 1)  # targets of the first i + 1 documents
    return min(n_docs, int(np.searchsorted(reach, max_tokens)) + 1)


def count_bytes(dataset, n_docs: int, tokenizer) -> int:
    """UTF-8 bytes of the first ``n_docs`` documents' text."""
    if n_docs == len(dataset) and hasattr(dataset, "n_bytes"):
        return int(dataset.n_bytes)  # the manifest's count, made from the text itself
    if getattr(tokenizer, "kind", None) == "byte":
        return int(sum(len(dataset[i]) for i in range(n_docs)))
    # decode(encode(text)) == text for lintime's tokenizers, so this is the text's byte count
    return int(sum(len(tokenizer.decode(dataset[i].tolist()).encode("utf-8")) for i in range(n_docs)))


def _windows(n_docs: int, dataset, L: int, bos: int, eos: int):
    """Yield ``(inputs, targets)`` int64 arrays, one per window (see the module docstring)."""
    for i in range(n_docs):
        doc = np.asarray(dataset[i], dtype=np.int64)
        seq = np.concatenate(([bos], doc, [eos]))
        n = len(seq) - 1  # inputs = seq[:-1], targets = seq[1:]
        for s in range(0, n, L):
            e = min(s + L, n)
            yield seq[s:e], seq[s + 1 : e + 1]


def _max_context(model) -> int | None:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "position", None) == "learned":
        return int(cfg.max_positions)
    return None


@torch.no_grad()
def score_context(
    model,
    dataset,
    n_docs: int,
    context_len: int,
    *,
    tokenizer,
    batch_tokens: int = 8192,
    autocast: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[float, int, int]:
    """``(sum of -ln p over all targets (float64), n_targets, n_windows)`` of the first
    ``n_docs`` documents at context length ``context_len`` (module docstring)."""
    device = next(model.parameters()).device
    cap = max(batch_tokens, context_len)
    total, n_targets, n_windows = 0.0, 0, 0
    buf_in: list[np.ndarray] = []
    buf_tg: list[np.ndarray] = []
    used = 0

    def flush() -> None:
        nonlocal total, n_targets, used
        lens = [len(x) for x in buf_in]
        ids = torch.from_numpy(np.concatenate(buf_in)).to(device)[None]  # [1, t]
        tg = torch.from_numpy(np.concatenate(buf_tg)).to(device)  # [t]
        cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)  # [N + 1]
        ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with ctx:
            logits = model(ids, cu_seqlens=cu)  # [1, t, V]
        nll = F.cross_entropy(logits[0].float(), tg, reduction="none")  # [t] fp32 per token
        total += float(nll.double().sum())
        n_targets += tg.numel()
        if progress is not None:
            progress(tg.numel())
        buf_in.clear()
        buf_tg.clear()
        used = 0

    for inp, tgt in _windows(n_docs, dataset, context_len, tokenizer.bos_id, tokenizer.eos_id):
        if used + len(inp) > cap:
            flush()
        buf_in.append(inp)
        buf_tg.append(tgt)
        used += len(inp)
        n_windows += 1
    if buf_in:
        flush()
    return total, n_targets, n_windows


def evaluate(
    model,
    dataset,
    context_lens=(512, 1024, 2048),
    *,
    tokenizer=None,
    max_tokens: int | None = None,
    batch_tokens: int = 8192,
    autocast: torch.dtype | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> EvalReport:
    """Score a causal LM on a prepared split (a :class:`lintime.data.TokenDataset`) at every
    context length of ``context_lens``; see the module docstring for the exact rule.

    ``tokenizer``: default ``dataset.tokenizer``.  ``max_tokens``: only the first documents, up
    to that many targets (whole documents).  ``batch_tokens``: tokens per model call (at least
    one window).  ``autocast``: e.g. ``torch.bfloat16`` (the loss is always computed in fp32 and
    summed in fp64).  ``progress(context_len, targets_done, targets_total)`` is called after every
    batch.  A context length the model cannot take (a learned position table shorter than ``L``)
    is reported as skipped rather than failing the others.
    """
    tok = tokenizer if tokenizer is not None else getattr(dataset, "tokenizer", None)
    if tok is None:
        raise ValueError("evaluate needs the tokenizer the split was made with")
    if getattr(model, "causal", True) is False:
        raise ValueError(f"{type(model).__name__} is a masked LM: bits per byte / perplexity are defined for causal LMs")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and tok.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {vocab}: not this model's tokenizer")
    lens = [int(L) for L in context_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"context lengths must be >= 1, got {list(context_lens)}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if len(dataset) == 0:
        raise ValueError("the split has no documents")
    n_docs = select_documents(dataset, max_tokens)
    n_bytes = count_bytes(dataset, n_docs, tok)
    lengths = np.asarray([len(dataset[i]) for i in range(n_docs)])
    n_targets_expected = int((lengths + 1).sum())
    if n_bytes == 0:
        raise ValueError("the evaluated documents hold no text (0 bytes)")
    report = EvalReport(
        split=getattr(dataset, "split", "?"), n_docs=n_docs, n_bytes=n_bytes,
        n_targets=n_targets_expected, tokenizer=tok.name,
    )
    limit = _max_context(model)
    was_training = model.training
    model.eval()
    try:
        for L in lens:
            if limit is not None and L > limit:
                report.results.append(ContextResult(L, skipped=f"longer than the model's learned position table ({limit})"))
                continue
            done = 0

            def tick(n: int, L=L) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(L, done, n_targets_expected)

            t0 = time.perf_counter()
            nll, n_targets, n_windows = score_context(
                model, dataset, n_docs, L, tokenizer=tok, batch_tokens=batch_tokens, autocast=autocast, progress=tick,
            )
            seconds = time.perf_counter() - t0
            assert n_targets == n_targets_expected, (n_targets, n_targets_expected)  # one exact pass
            loss = nll / n_targets
            report.results.append(ContextResult(
                context_len=L,
                loss=loss,
                bits_per_token=loss / math.log(2),
                bits_per_byte=nll / math.log(2) / n_bytes,
                perplexity=math.exp(min(loss, 700.0)),
                n_targets=n_targets,
                n_windows=n_windows,
                seconds=seconds,
                tokens_per_s=n_targets / seconds if seconds > 0 else 0.0,
            ))
    finally:
        model.train(was_training)
    return report
