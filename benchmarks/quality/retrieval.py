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
