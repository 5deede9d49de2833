"""Length extrapolation: bits per byte by position, up to many times the trained context.

Documents of the held-out split are cut, from their start, into windows of exactly ``L`` inputs
(``L`` = ``factor`` x the trained length; a document of ``n`` tokens gives ``floor((n + 1) / L)``
windows, the rule of :mod:`lintime.evaluation.lm` restricted to whole windows: shorter documents
and a document's last, partial window are left out), so **every position bucket is scored on the
same windows** and the curve shows the effect of position alone, not of which documents are long.
Each window is one independent sequence (no state carried in).

A target at position ``p`` of its window (``0 <= p < L``, predicted from ``p + 1`` tokens) falls in
bucket ``p // bucket`` (``bucket`` = the trained length by default: bucket 0 is what training
saw, the others are extrapolation).  Per bucket::

    bits_per_byte = sum(-ln p(target)) / ln 2 / bytes(targets)

``bytes(target)``: 1 for a byte-tokenizer id below 256, 0 for the special ids (``eos``); for a
BPE, the UTF-8 length of the token decoded alone (exact for whole characters, an estimate for a
token holding part of one).  ``bits_per_token`` is given too.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Bucket:
    start: int  # first position of the bucket
    stop: int  # one past its last position
    n_targets: int
    n_bytes: int
    bits_per_byte: float
    bits_per_token: float


@dataclasses.dataclass
class ExtrapolationReport:
    split: str
    trained_len: int | None
    window: int  # L
    bucket: int
    n_windows: int
    n_docs: int
    tokenizer: str
    seconds: float
    buckets: list[Bucket] = dataclasses.field(default_factory=list)
    skipped: str | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for b in out["buckets"]:
            for k, v in b.items():
                if isinstance(v, float) and not math.isfinite(v):
                    b[k] = None
        return out


def token_bytes(tokenizer, vocab_size: int) -> np.ndarray:
    """``[vocab_size]`` UTF-8 bytes each id stands for (module docstring)."""
    if getattr(tokenizer, "kind", None) == "byte":
        out = np.zeros(vocab_size, dtype=np.int64)
        out[:256] = 1
        return out
    specials = set(getattr(tokenizer, "special_ids", ()) or ())
    n = min(vocab_size, tokenizer.vocab_size)
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(n):
        if i not in specials:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def windows(dataset, L: int, bos: int, eos: int, max_windows: int | None):
    """``(inputs [L], targets [L], document index)`` of every whole window (module docstring),
    documents in split order, at most ``max_windows``."""
    count = 0
    for i in range(len(dataset)):
        doc = np.asarray(dataset[i], dtype=np.int64)
        if len(doc) + 1 < L:
            continue
        seq = np.concatenate(([bos], doc, [eos]))
        for s in range(0, len(seq) - 1 - L + 1, L):
            yield seq[s : s + L], seq[s + 1 : s + L + 1], i
            count += 1
            if max_windows is not None and count >= max_windows:
                return


@torch.no_grad()
def evaluate_extrapolation(
    model,
    dataset,
    *,
    tokenizer,
    trained_len: int | None,
    factor: int = 8,
    bucket: int | None = None,
    max_windows: int | None = 64,
    batch_tokens: int = 16384,
    autocast: torch.dtype | None = None,
) -> ExtrapolationReport:
    """Bits per byte by position bucket over windows of ``factor * trained_len`` tokens (module
    docstring).  ``bucket``: bucket width (default ``trained_len``).  ``max_windows``: the first
    that many windows (``None``: all).  A window longer than a learned position table is
    reported as skipped."""
    if trained_len is None and bucket is None:
        raise ValueError("the trained context length is unknown: give the bucket width (and the window length)")
    base = trained_len or bucket
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    L = factor * base
    width = bucket or base
    if width < 1 or width > L:
        raise ValueError(f"bucket must be in [1, {L}], got {width}")
    name = getattr(tokenizer, "name", "?")
    report = ExtrapolationReport(split=getattr(dataset, "split", "?"), trained_len=trained_len, window=L, bucket=width,
                                 n_windows=0, n_docs=0, tokenizer=name, seconds=0.0)
    cfg = model.config
    if getattr(cfg, "position", None) == "learned" and cfg.max_positions < L:
        report.skipped = f"longer than the model's learned position table ({cfg.max_positions})"
        return report
    nb = math.ceil(L / width)
    nll = np.zeros(nb, dtype=np.float64)
    n_tok = np.zeros(nb, dtype=np.int64)
    n_bytes = np.zeros(nb, dtype=np.int64)
    nbytes_of = torch.from_numpy(token_bytes(tokenizer, cfg.vocab_size))
    which = torch.arange(L) // width  # [L] bucket of each position
    device = next(model.parameters()).device
    rows = max(1, batch_tokens // L)
    docs: set[int] = set()
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    buf_in, buf_tg = [], []

    def flush() -> None:
        x = torch.from_numpy(np.stack(buf_in)).to(device)  # [b, L]
        y = torch.from_numpy(np.stack(buf_tg))  # [b, L]
        ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else torch.autocast(device.type, enabled=False)
        with ctx:
            logits = model(x)  # [b, L, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="none").double().cpu()
        loss = loss.view(y.shape)  # [b, L]
        idx = which.expand_as(y)
        nll[:] += np.bincount(idx.flatten().numpy(), weights=loss.flatten().numpy(), minlength=nb)
        n_tok[:] += np.bincount(idx.flatten().numpy(), minlength=nb)
        n_bytes[:] += np.bincount(idx.flatten().numpy(), weights=nbytes_of[y].flatten().numpy(), minlength=nb).astype(np.int64)
        buf_in.clear()
        buf_tg.clear()

    try:
        for inp, tgt, doc in windows(dataset, L, tokenizer.bos_id, tokenizer.eos_id, max_windows):
            buf_in.append(inp)
            buf_tg.append(tgt)
            docs.add(doc)
            report.n_windows += 1
            if len(buf_in) == rows:
                flush()
        if buf_in:
            flush()
    finally:
        model.train(was_training)
    report.seconds = time.perf_counter() - t0
    report.n_docs = len(docs)
    if report.n_windows == 0:
        report.skipped = f"no document of the split holds {L} tokens"
        return report
    for k in range(nb):
        report.buckets.append(Bucket(
            start=k * width, stop=min((k + 1) * width, L), n_targets=int(n_tok[k]), n_bytes=int(n_bytes[k]),
            bits_per_byte=float(nll[k] / math.log(2) / n_bytes[k]) if n_bytes[k] else math.nan,
            bits_per_token=float(nll[k] / math.log(2) / n_tok[k]),
        ))
    return report


def format_extrapolation(report: ExtrapolationReport) -> str:
    from lintime.evaluation.tasks.report import table

    if report.skipped:
        return f"skipped: {report.skipped}"
    rows = []
    for b in report.buckets:
        mark = "*" if report.trained_len and b.start >= report.trained_len else ""
        rows.append([f"{b.start}-{b.stop - 1}{mark}", f"{b.bits_per_byte:.4f}", f"{b.bits_per_token:.4f}", f"{b.n_targets:,}"])
    text = table(["positions", "bits/byte", "bits/token", "targets"], rows)
    if report.trained_len:
        text += f"\n* beyond the training context ({report.trained_len}): length extrapolation"
    return text


def plot_extrapolation(reports: dict, path, *, title: str = "") -> None:
    """Bits per byte against position (bucket middles), one curve per model: ``reports`` maps a
    label to an :class:`ExtrapolationReport` or its ``to_dict()``."""
    from lintime.evaluation.tasks.report import figure

    with figure(path, title or "length extrapolation", "position in the window (tokens)", "bits per byte") as ax:
        trained = set()
        for label, rep in reports.items():
            r = rep if isinstance(rep, dict) else rep.to_dict()
            pts = [((b["start"] + b["stop"]) / 2, b["bits_per_byte"]) for b in r["buckets"] if b["bits_per_byte"] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=label)
            if r.get("trained_len"):
                trained.add(r["trained_len"])
        for t in sorted(trained):
            ax.axvline(t, color="grey", ls="--", lw=0.8)
