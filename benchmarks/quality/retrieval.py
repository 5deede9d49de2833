"""Retrieval on a study run's model (issue 43 item 3): passkey and a multi-key needle at the run's
trained context and at 2x and 4x it (extrapolation), inside a time budget.

* **passkey**: lintime's own task, :func:`lintime.evaluation.tasks.passkey.evaluate_passkey`
  (imported, not copied): one 5-digit key in filler text, read back by greedy decoding.
* **needle** (multi-key; lintime has no such task, so it lives here): :data:`N_KEYS` key/value
  pairs ``"# The value of key <name> is <5 digits>."`` hidden in the same filler; the question asks
  for one of them (the one at ``depth``; the others at seeded random places); a trial is correct
  when the greedy continuation's first digits are that key's value.  ``distractor`` counts answers
  that are another pair's value (the model retrieved, but the wrong key).  It reuses passkey's
  filler stream, key generator and greedy decoding.

The filler is the **study corpus's test split** (``open_corpus(<corpus folder>)``, lintime's
path-hash split; never trained on).  Trials are seeded per (length, depth, trial) exactly like
passkey's.  :func:`measure` runs the cells in the order passkey 1x, needle 1x, passkey 2x,
needle 2x, passkey 4x, needle 4x, and before each one estimates its time from the cells already
measured (a length's cost scaled by the length ratio, squared for a softmax model); a cell that
would end past ``deadline`` is recorded ``"not run"`` with the reason.
"""

from __future__ import annotations

import math
import time

import numpy as np

N_KEYS = 4
DIGITS = 5
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MULTIPLES = (1, 2, 4)
TASKS = ("passkey", "needle")
PAIR = "\n# The value of key {name} is {value}.\n"
ASK = "\n# What is the value of key {name}? The value of key {name} is "
BATCH_TOKENS = 8 * 32768  # prompt tokens per decoding batch (passkey_sweep's bound: 8 prompts of 32k)


# ------------------------------------------------------------------------------------------- needle


def needle_trial(seed: int, context_len: int, depth: float, trial: int, n_keys: int = N_KEYS,
                 digits: int = DIGITS) -> tuple[list[tuple[str, str]], int, np.random.Generator]:
    """The pairs of one trial, the index of the asked pair and the generator that then places the
    others and picks the filler.  Names: 6 lowercase letters, distinct; values distinct."""
    from lintime.evaluation.tasks.passkey import trial_key

    _, rng = trial_key(seed + 7919, context_len, depth, trial, digits)  # passkey's seeding, another stream
    names: list[str] = []
    values: list[str] = []
    while len(names) < n_keys:
        name = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, 6))
        value = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
        if name not in names and value not in values:
            names.append(name)
            values.append(value)
    return list(zip(names, values)), int(rng.integers(n_keys)), rng


def needle_min_len(tokenizer, n_keys: int = N_KEYS, digits: int = DIGITS) -> int:
    """The shortest context that holds ``bos``, the pairs and the question (no filler)."""
    name, value = "abcdef", "1" * digits
    return 1 + n_keys * len(tokenizer.encode(PAIR.format(name=name, value=value))) + len(
        tokenizer.encode(ASK.format(name=name)))


def make_needle_prompt(stream, tokenizer, context_len: int, depth: float, pairs: list[tuple[str, str]], asked: int,
                       rng: np.random.Generator) -> list[int]:
    """``context_len`` token ids: ``bos``, filler with the pairs in it (the asked one at ``depth``
    of the filler, the others at uniform random places), the question."""
    pieces = [tokenizer.encode(PAIR.format(name=n, value=v)) for n, v in pairs]
    question = tokenizer.encode(ASK.format(name=pairs[asked][0]))
    F = context_len - 1 - sum(len(p) for p in pieces) - len(question)
    if F < 0:
        raise ValueError(f"context length {context_len} is shorter than {len(pairs)} pairs and the question")
    cuts = [float(rng.random()) for _ in pairs]
    cuts[asked] = depth
    filler = stream.take(rng, F).tolist()
    order = sorted(range(len(pairs)), key=lambda i: (cuts[i], i != asked))
    out, prev = [tokenizer.bos_id], 0
    for i in order:
        cut = round(cuts[i] * F)
        out += filler[prev:cut] + pieces[i]
        prev = cut
    return out + filler[prev:] + question


def evaluate_needle(model, tokenizer, stream, context_len: int, depths=DEPTHS, *, trials: int = 10,
                    n_keys: int = N_KEYS, digits: int = DIGITS, seed: int = 0, batch_size: int = 8,
                    chunk_size: int = 4096, autocast=None, decode=None) -> list[dict]:
    """Accuracy of the multi-key needle at one length, per depth: ``[{depth, trials, correct,
    accuracy, distractor, answers}]``.  ``decode(model, prompts [B, L], n_tokens)`` -> token ids
    (default: passkey's greedy decoding through the model's decoding state)."""
    import torch

    from lintime.evaluation.tasks.passkey import greedy_continuations

    if decode is None:
        def decode(m, rows, n):
            return greedy_continuations(m, rows, n, chunk_size=chunk_size, autocast=autocast)
    prompts, truth = [], []
    for depth in depths:
        for t in range(trials):
            pairs, asked, rng = needle_trial(seed, context_len, depth, t, n_keys, digits)
            prompts.append(make_needle_prompt(stream, tokenizer, context_len, depth, pairs, asked, rng))
            truth.append((pairs[asked][1], {v for i, (_, v) in enumerate(pairs) if i != asked}))
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    answers: list[str] = []
    try:
        for b in range(0, len(prompts), batch_size):
            rows = torch.tensor(prompts[b : b + batch_size], dtype=torch.long)
            answers += [tokenizer.decode(ids)[:digits] for ids in decode(model, rows, digits + 4)]
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    cells = []
    for i, depth in enumerate(depths):
        got = answers[i * trials : (i + 1) * trials]
        want = truth[i * trials : (i + 1) * trials]
        correct = sum(a == v for a, (v, _) in zip(got, want))
        distractor = sum(a in others for a, (_, others) in zip(got, want))
        cells.append({"depth": depth, "trials": trials, "correct": correct, "accuracy": correct / trials,
                      "distractor": distractor, "answers": got})
    return cells


# ------------------------------------------------------------------------------------------- the run's measurement


def _quadratic(model) -> bool:
    """Whether the model's prefill cost grows with the square of the length (softmax attention)."""
    cfg = getattr(model, "config", None)
    text = repr(getattr(cfg, "mixer", cfg)).lower()
    return "softmax" in text


def estimate_s(done: list[dict], task: str, length: int, quadratic: bool, margin: float = 1.3) -> float | None:
    """A cell's time from the cells measured: the same length of another task (same prompt count),
    else the longest shorter length scaled by the length ratio (squared for a softmax model)."""
    same = [c["seconds"] for c in done if c["context_len"] == length and c["status"] == "done"]
    if same:
        return max(same) * margin
    prev = [c for c in done if c["status"] == "done" and c["context_len"] < length and c["task"] == task]
    if not prev:
        prev = [c for c in done if c["status"] == "done" and c["context_len"] < length]
    if not prev:
        return None
    c = max(prev, key=lambda c: (c["context_len"], c["seconds"]))
    r = length / c["context_len"]
    return c["seconds"] * (r * r if quadratic else r) * margin


def measure(model, tokenizer, context: int, *, corpus: str, deadline: float, trials: int = 10,
            depths=DEPTHS, multiples=MULTIPLES, tasks=TASKS, seed: int = 0, autocast=None, chunk_size: int = 4096,
            first_estimate_s: float | None = None, clock=time.monotonic, say=None, decode=None) -> dict:
    """Passkey and needle at ``context`` x each of ``multiples``; ``trials`` per depth (so
    ``trials x len(depths)`` a length).  The ``retrieval`` entry of a run record: settings and a
    list of cells ``{task, multiple, context_len, status: done | not run | failed, accuracy,
    correct, trials, by_depth, seconds, why}``.  ``first_estimate_s``: the first cell's expected
    time (None: run it if any time is left)."""
    from lintime.evaluation.tasks.passkey import FillerStream, evaluate_passkey, filler_text

    quadratic = _quadratic(model)
    lengths = [context * m for m in multiples]
    t0 = clock()
    out = {"settings": {"trials_per_depth": trials, "depths": list(depths), "digits": DIGITS, "n_keys": N_KEYS,
                        "seed": seed, "filler": f"{corpus} (test split)", "multiples": list(multiples),
                        "trained_context": context, "batch_tokens": BATCH_TOKENS},
           "cells": []}
    stream = None
    for m, L in zip(multiples, lengths):
        for task in tasks:
            cell = {"task": task, "multiple": m, "context_len": L, "status": "not run"}
            left = deadline - clock()
            est = estimate_s(out["cells"], task, L, quadratic)
            if est is None and first_estimate_s is not None:  # nothing measured yet: the first cell's guess, scaled
                r = L / lengths[0]
                est = first_estimate_s * (r * r if quadratic else r)
            if left <= 0 or (est is not None and est > left):
                cell["why"] = f"needs ~{est:.0f} s, {max(left, 0):.0f} s left" if est is not None else "no time left"
                out["cells"].append(cell)
                continue
            if task == "needle" and L < needle_min_len(tokenizer):
                cell["why"] = f"shorter than {N_KEYS} pairs and the question ({needle_min_len(tokenizer)} tokens)"
                out["cells"].append(cell)
                continue
            batch = max(1, min(len(depths) * trials, BATCH_TOKENS // L))
            s0 = clock()
            try:
                if task == "passkey":
                    if decode is not None:
                        raise ValueError("a stub decoder is for the needle only")
                    rep = evaluate_passkey(model, tokenizer, [L], depths, trials=trials, digits=DIGITS, seed=seed,
                                           corpus=corpus, batch_size=batch, chunk_size=chunk_size, autocast=autocast)
                    skipped = next((c.skipped for c in rep.cells if c.skipped), None)
                    if skipped:
                        cell.update(status="not run", why=skipped)
                        out["cells"].append(cell)
                        continue
                    by = [{"depth": c.depth, "trials": c.trials, "correct": c.correct, "accuracy": c.accuracy}
                          for c in rep.cells]
                else:
                    if stream is None:
                        stream = FillerStream(filler_text(corpus, min_chars=max(lengths) * 8), tokenizer)
                    by = evaluate_needle(model, tokenizer, stream, L, depths, trials=trials, seed=seed,
                                         batch_size=batch, chunk_size=chunk_size, autocast=autocast, decode=decode)
                n = sum(c["trials"] for c in by)
                k = sum(c["correct"] for c in by)
                cell.update(status="done", trials=n, correct=k, accuracy=k / n, by_depth=by, seconds=clock() - s0)
            except Exception as err:  # noqa: BLE001 - an out-of-memory at 4x: the record says so, the rest goes on
                cell.update(status="failed", why=f"{type(err).__name__}: {' '.join(str(err).split())[:300]}",
                            seconds=clock() - s0)
                _free_memory()
            out["cells"].append(cell)
            if say is not None:
                say(f"retrieval {task} {L} ({m}x): {cell['status']}"
                    + (f" {cell['accuracy']:.2f}" if cell["status"] == "done" else f" ({cell.get('why')})")
                    + f" [{clock() - s0:.1f} s]")
    out["seconds"] = clock() - t0
    return out


def not_run(context: int, why: str, multiples=MULTIPLES, tasks=TASKS) -> dict:
    """The ``retrieval`` entry of a run that did not measure it (``--no-retrieval``, a failed run)."""
    return {"settings": {"trained_context": context, "multiples": list(multiples)},
            "cells": [{"task": t, "multiple": m, "context_len": context * m, "status": "not run", "why": why}
                      for m in multiples for t in tasks]}


def cell(retrieval: dict | None, task: str, multiple: int) -> dict | None:
    """The cell of ``task`` at ``multiple`` x the trained context in a record's ``retrieval``."""
    for c in (retrieval or {}).get("cells", []):
        if c.get("task") == task and c.get("multiple") == multiple:
            return c
    return None


def accuracy(retrieval: dict | None, task: str, multiple: int) -> float | None:
    c = cell(retrieval, task, multiple)
    if not c or c.get("status") != "done" or c.get("accuracy") is None:
        return None
    a = float(c["accuracy"])
    return a if math.isfinite(a) else None


def _free_memory() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------- the fine-tune's documents
#
# The retrieval fine-tune (run.py, after a run's "as trained" retrieval) trains the run's final model a few steps on a
# mixture of the study corpus's TRAIN split and synthetic passkey / needle documents in the formats above, then
# measures retrieval again.  Its documents come from here:
#
# * text only from the train split (``open_corpus(corpus).documents("train")``): never the test split, whose documents
#   are the evaluation's filler;
# * keys, names and values from their own generator stream (:data:`FT_SEED_TAG`, the run's seed, the document index),
#   and every key / value / name the evaluation of that run draws (:func:`evaluation_secrets`) is refused: a fine-tuned
#   model cannot have seen the answer to any evaluation prompt;
# * every document exactly ``context_len - 2`` byte tokens, so with lintime's ``bos`` / ``eos`` each fills one
#   training row (lintime packs documents into a stream read ``context_len`` tokens a row: documents of exactly a row
#   never straddle two rows, so no synthetic document loses its key to a row boundary).

FT_SEED_TAG = 0x52465431  # "RFT1": the fine-tune documents' generator stream (the evaluation's: trial_key's)
ANSWER = "{value}.\n"  # what follows the question in a fine-tune document


def evaluation_secrets(seed: int, context: int, *, multiples=MULTIPLES, depths=DEPTHS, trials: int = 10,
                       n_keys: int = N_KEYS, digits: int = DIGITS) -> tuple[set[str], set[str]]:
    """``(values, names)`` the evaluation of a run with ``seed`` draws (:func:`measure`'s trials: passkey's keys,
    the needle's values and key names) at ``context`` x each multiple."""
    from lintime.evaluation.tasks.passkey import trial_key

    values: set[str] = set()
    names: set[str] = set()
    for m in multiples:
        L = context * m
        for depth in depths:
            for t in range(trials):
                values.add(trial_key(seed, L, depth, t, digits)[0])
                pairs, _, _ = needle_trial(seed, L, depth, t, n_keys, digits)
                names.update(n for n, _ in pairs)
                values.update(v for _, v in pairs)
    return values, names


def train_texts(corpus: str, min_chars: int, rng: np.random.Generator) -> list[str]:
    """Documents of ``corpus``'s **train** split, a seeded random subset holding at least ``min_chars`` characters
    (the whole split when it holds fewer)."""
    from lintime.data import open_corpus

    docs = [d.text for d in open_corpus(corpus).documents("train") if d.text]
    if not docs:
        raise ValueError(f"corpus {corpus!r} has no train documents")
    out, total = [], 0
    for i in rng.permutation(len(docs)):
        out.append(docs[int(i)])
        total += len(docs[int(i)])
        if total >= min_chars:
            break
    return out


class TextStream:
    """Train-split text as one string (``\\n`` between documents), read from any document start, in UTF-8 bytes."""

    def __init__(self, docs: list[str]):
        self.text = "".join(d + "\n" for d in docs)
        starts, pos = [], 0
        for d in docs:
            starts.append(pos)
            pos += len(d) + 1
        self.starts = starts

    def take(self, rng: np.random.Generator, n_bytes: int) -> str:
        """At most ``n_bytes`` UTF-8 bytes (whole characters) from a random document start, wrapping around."""
        start = self.starts[int(rng.integers(len(self.starts)))]
        out, have = [], 0
        pos = start
        while have < n_bytes:
            piece = self.text[pos : pos + n_bytes - have]  # characters >= 1 byte each: never short of bytes
            b = piece.encode("utf-8")[: n_bytes - have].decode("utf-8", errors="ignore")
            out.append(b)
            have += len(b.encode("utf-8"))
            pos += len(b)
            if pos >= len(self.text):
                pos = 0
            if not b:  # a character wider than what is left: pad
                break
        s = "".join(out)
        return s + "\n" * (n_bytes - len(s.encode("utf-8")))


def _split_at_byte(s: str, cut: int) -> tuple[str, str]:
    head = s.encode("utf-8")[:cut].decode("utf-8", errors="ignore")
    return head, s[len(head):]


def _draw(rng: np.random.Generator, digits: int, banned: set[str]) -> str:
    while True:
        v = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
        if v not in banned:
            return v


def _name(rng: np.random.Generator, banned: set[str]) -> str:
    while True:
        n = "".join(chr(97 + int(c)) for c in rng.integers(0, 26, 6))
        if n not in banned:
            return n


def passkey_document(stream: TextStream, n_bytes: int, rng: np.random.Generator, banned_values: set[str],
                     digits: int = DIGITS) -> tuple[str, dict]:
    """A passkey document of exactly ``n_bytes`` UTF-8 bytes: filler, passkey's needle at a random depth, filler,
    passkey's question and the key."""
    from lintime.evaluation.tasks.passkey import NEEDLE, QUESTION

    key = _draw(rng, digits, banned_values)
    needle, tail = NEEDLE.format(key=key), QUESTION + ANSWER.format(value=key)
    F = n_bytes - len(needle.encode()) - len(tail.encode())
    if F < 0:
        raise ValueError(f"{n_bytes} bytes hold no passkey document")
    depth = float(rng.random())
    head, rest = _split_at_byte(stream.take(rng, F), round(depth * F))
    return head + needle + rest + tail, {"key": key, "depth": depth}


def needle_document(stream: TextStream, n_bytes: int, rng: np.random.Generator, banned_values: set[str],
                    banned_names: set[str], n_keys: int = N_KEYS, digits: int = DIGITS) -> tuple[str, dict]:
    """A multi-key needle document of exactly ``n_bytes`` UTF-8 bytes: ``n_keys`` pairs in filler (the asked one at a
    random depth, the others at random places), the question and the asked value."""
    names: list[str] = []
    values: list[str] = []
    while len(names) < n_keys:
        n, v = _name(rng, banned_names | set(names)), _draw(rng, digits, banned_values | set(values))
        names.append(n)
        values.append(v)
    asked = int(rng.integers(n_keys))
    pieces = [PAIR.format(name=n, value=v) for n, v in zip(names, values)]
    tail = ASK.format(name=names[asked]) + ANSWER.format(value=values[asked])
    F = n_bytes - sum(len(p.encode()) for p in pieces) - len(tail.encode())
    if F < 0:
        raise ValueError(f"{n_bytes} bytes hold no needle document")
    cuts = [float(rng.random()) for _ in pieces]
    filler = stream.take(rng, F)
    order = sorted(range(n_keys), key=lambda i: (cuts[i], i != asked))
    out, done_bytes, rest = [], 0, filler
    for i in order:
        head, rest = _split_at_byte(rest, round(cuts[i] * F) - done_bytes)
        done_bytes += len(head.encode())
        out += [head, pieces[i]]
    return "".join(out) + rest + tail, {"key": values[asked], "name": names[asked], "depth": cuts[asked],
                                        "values": values, "names": names}


def needle_fits(n_bytes: int, n_keys: int = N_KEYS, digits: int = DIGITS) -> bool:
    name, value = "abcdef", "1" * digits
    return n_bytes >= n_keys * len(PAIR.format(name=name, value=value)) + len(
        (ASK.format(name=name) + ANSWER.format(value=value)).encode())


def fine_tune_documents(corpus: str, context: int, n_docs: int, *, mix: float, seed: int,
                        eval_multiples=MULTIPLES, eval_depths=DEPTHS, eval_trials: int = 10) -> tuple[list[dict], dict]:
    """The fine-tune's documents: ``n_docs`` records ``{"text", "kind"}`` (kind ``text`` / ``passkey`` / ``needle``),
    each exactly ``context - 2`` UTF-8 bytes (byte tokenizer: one training row with ``bos`` / ``eos``), a fraction
    ``mix`` of them synthetic (half passkey, half needle; all passkey where the needle does not fit), in a seeded
    random order; and a summary (counts, bytes, what the keys avoid).  Text only from ``corpus``'s train split;
    keys, values and names never any that the evaluation of a run with ``seed`` draws (``eval_*``: its settings)."""
    n_bytes = context - 2
    rng = np.random.default_rng([FT_SEED_TAG, seed])
    banned_values, banned_names = evaluation_secrets(seed, context, multiples=eval_multiples, depths=eval_depths,
                                                     trials=eval_trials)
    stream = TextStream(train_texts(corpus, min_chars=n_docs * n_bytes + 1, rng=rng))
    n_syn = round(mix * n_docs)
    with_needle = needle_fits(n_bytes)
    n_needle = n_syn // 2 if with_needle else 0
    kinds = ["needle"] * n_needle + ["passkey"] * (n_syn - n_needle) + ["text"] * (n_docs - n_syn)
    kinds = [kinds[int(i)] for i in rng.permutation(len(kinds))]
    docs = []
    for i, kind in enumerate(kinds):
        r = np.random.default_rng([FT_SEED_TAG, seed, i])
        if kind == "passkey":
            text, _ = passkey_document(stream, n_bytes, r, banned_values)
        elif kind == "needle":
            text, _ = needle_document(stream, n_bytes, r, banned_values, banned_names)
        else:
            text = stream.take(r, n_bytes)
        docs.append({"text": text, "kind": kind})
    summary = {"documents": n_docs, "bytes_each": n_bytes, "passkey": kinds.count("passkey"),
               "needle": kinds.count("needle"), "text": kinds.count("text"), "mix": n_syn / n_docs if n_docs else 0.0,
               "needle_fits": with_needle, "filler": f"{corpus} (train split)", "seed_stream": [FT_SEED_TAG, seed],
               "avoids": f"the {len(banned_values)} values and {len(banned_names)} names the evaluation draws"}
    return docs, summary
