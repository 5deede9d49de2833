"""Passkey retrieval: a number hidden at a chosen depth in filler text, read back by greedy decoding
(the test of Mohtashami & Jaggi, "Landmark Attention", 2023, with code as the filler).

One prompt of exactly ``L`` tokens (``L`` = the context length, ``bos`` included)::

    bos  filler[:cut]  NEEDLE  filler[cut:F]  QUESTION         then greedy decoding of the digits

* ``NEEDLE`` = ``"\\n# The pass key is 48213. Remember it. 48213 is the pass key.\\n"``,
  ``QUESTION`` = ``"\\n# What is the pass key? The pass key is "`` (Python comments: the
  built-in corpus is Python source);
* the filler is held-out text -- the ``test`` split of the built-in corpus (the Python standard
  library's sources, :func:`lintime.data.open_corpus`), never trained on -- tokenised with the
  model's tokenizer; each trial starts it at another document (seeded);
* ``F = L - 1 - len(NEEDLE) - len(QUESTION)`` filler tokens, ``cut = round(depth * F)``: depth 0
  puts the needle right after ``bos``, depth 1 right before the question;
* the key has ``digits`` digits (first digit not 0), drawn per trial from
  ``numpy.random.default_rng([seed, L, round(depth * 1000), trial])``;
* a trial is correct when the greedy continuation's first ``digits`` characters are the key
  (decoding stops after ``digits`` + 4 tokens, enough for any tokenizer's digit pieces).

Accuracy is reported per (context length, depth) cell over ``trials`` prompts.  The prompt is run
through the model's decoding state (:func:`lintime.generation.prefill` in pieces of
``chunk_size`` tokens), so linear-time families use constant memory at any length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

NEEDLE = "\n# The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n# What is the pass key? The pass key is "


@dataclasses.dataclass
class PasskeyCell:
    """Accuracy at one (context length, depth)."""

    context_len: int
    depth: float
    trials: int
    correct: int
    accuracy: float
    seconds: float  # the length's time over its depths (their prompts are decoded together)
    answers: list[str] = dataclasses.field(default_factory=list)  # the decoded digits of each trial
    skipped: str | None = None


@dataclasses.dataclass
class PasskeyReport:
    digits: int
    seed: int
    filler: str
    cells: list[PasskeyCell] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for c in out["cells"]:
            if isinstance(c["accuracy"], float) and not math.isfinite(c["accuracy"]):
                c["accuracy"] = None
        return out


def filler_text(corpus: str = "stdlib", min_chars: int = 1 << 20) -> list[str]:
    """Held-out documents of ``corpus`` (its ``test`` split), in key order, until they hold
    ``min_chars`` characters (the whole split when it holds fewer)."""
    from lintime.data import open_corpus

    docs, total = [], 0
    for doc in open_corpus(corpus).documents("test"):
        docs.append(doc.text)
        total += len(doc.text)
        if total >= min_chars:
            break
    if not docs:
        raise ValueError(f"corpus {corpus!r} has no test documents to use as filler")
    return docs


class FillerStream:
    """The filler documents as one token stream (``\\n`` between documents), readable from any
    document start."""

    def __init__(self, docs: list[str], tokenizer):
        pieces = [np.asarray(tokenizer.encode(d + "\n"), dtype=np.int64) for d in docs]
        self.starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        self.ids = np.concatenate(pieces)

    def take(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` tokens from the start of a random document (wrapping around the stream)."""
        start = int(self.starts[rng.integers(len(self.starts))])
        reps = (start + n) // len(self.ids) + 1
        ids = np.tile(self.ids, reps) if reps > 1 else self.ids
        return ids[start : start + n]


def make_prompt(stream: FillerStream, tokenizer, context_len: int, depth: float, key: str,
                rng: np.random.Generator) -> list[int]:
    """The ``context_len`` token ids of one trial (module docstring)."""
    needle = tokenizer.encode(NEEDLE.format(key=key))
    question = tokenizer.encode(QUESTION)
    F = context_len - 1 - len(needle) - len(question)
    if F < 0:
        raise ValueError(f"context length {context_len} is shorter than the needle and the question "
                         f"({len(needle) + len(question) + 1} tokens)")
    filler = stream.take(rng, F).tolist()
    cut = round(depth * F)
    return [tokenizer.bos_id] + filler[:cut] + needle + filler[cut:] + question


def trial_key(seed: int, context_len: int, depth: float, trial: int, digits: int) -> tuple[str, np.random.Generator]:
    """The key of one trial and the generator that then picks its filler."""
    rng = np.random.default_rng([seed, context_len, round(depth * 1000), trial])
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    return key, rng


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, n_tokens: int, *, chunk_size: int = 4096,
                         autocast: torch.dtype | None = None) -> list[list[int]]:
    """``n_tokens`` greedy tokens after each row of ``prompts`` ``[B, L]`` (prefill through the
    decoding state, then one token at a time)."""
    from lintime.generation import decode_one_token, prefill

    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else torch.autocast(device.type, enabled=False)
    with ctx:
        logits, state = prefill(model, prompts.to(device), chunk_size=chunk_size)
        out = []
        for _ in range(n_tokens):
            tok = logits.float().argmax(-1)  # [B]
            out.append(tok)
            logits, state = decode_one_token(model, tok, state)
    return torch.stack(out, 1).tolist()


def evaluate_passkey(
    model,
    tokenizer,
    context_lens=(1024, 2048, 4096),
    depths=(0.0, 0.25, 0.5, 0.75, 1.0),
    *,
    trials: int = 10,
    digits: int = 5,
    seed: int = 0,
    corpus: str = "stdlib",
    batch_size: int = 8,
    chunk_size: int = 4096,
    autocast: torch.dtype | None = None,
    progress=None,
) -> PasskeyReport:
    """Passkey accuracy of ``model`` for every (context length, depth); see the module docstring.

    ``batch_size``: prompts decoded together (all of one length, any depths).  A cell's
    ``seconds`` is its length's time shared equally by the depths.  ``progress(done, total)``:
    called after every cell.  A context longer than a learned position table is skipped."""
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in [1, 18], got {digits}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    bad = [d for d in depths if not 0 <= d <= 1]
    if bad:
        raise ValueError(f"depths are fractions in [0, 1], got {bad}")
    lens = [int(L) for L in context_lens]
    cfg = model.config
    limit = cfg.max_positions if getattr(cfg, "position", None) == "learned" else None
    stream = FillerStream(filler_text(corpus, min_chars=max(lens) * 8), tokenizer)
    report = PasskeyReport(digits=digits, seed=seed, filler=f"{corpus} (test split)")
    was_training = model.training
    model.eval()
    total = len(lens) * len(depths)
    try:
        for L in lens:
            if limit is not None and L > limit:
                for depth in depths:
                    report.cells.append(PasskeyCell(L, depth, 0, 0, math.nan, 0.0,
                                                    skipped=f"longer than the model's learned position table ({limit})"))
                continue
            # every depth's prompts of this length in one list, decoded batch_size at a time: a
            # model call costs mostly fixed host work, so the calls, not the rows, set the time
            t0 = time.perf_counter()
            keys, prompts = [], []
            for depth in depths:
                for t in range(trials):
                    key, rng = trial_key(seed, L, depth, t, digits)
                    keys.append(key)
                    prompts.append(make_prompt(stream, tokenizer, L, depth, key, rng))
            answers = []
            for b in range(0, len(prompts), batch_size):
                rows = torch.tensor(prompts[b : b + batch_size], dtype=torch.long)
                for ids in greedy_continuations(model, rows, digits + 4, chunk_size=chunk_size, autocast=autocast):
                    answers.append(tokenizer.decode(ids)[:digits])
            share = (time.perf_counter() - t0) / len(depths)
            for i, depth in enumerate(depths):
                got, want = answers[i * trials : (i + 1) * trials], keys[i * trials : (i + 1) * trials]
                correct = sum(a == k for a, k in zip(got, want))
                report.cells.append(PasskeyCell(L, depth, trials, correct, correct / trials, share, got))
                if progress is not None:
                    progress(len(report.cells), total)
    finally:
        model.train(was_training)
    return report


def format_passkey(report: PasskeyReport) -> str:
    """Accuracy as a table: one row per context length, one column per depth."""
    from lintime.evaluation.tasks.report import table

    depths = sorted({c.depth for c in report.cells})
    rows = []
    for L in sorted({c.context_len for c in report.cells}):
        cells = {c.depth: c for c in report.cells if c.context_len == L}
        skipped = next((c.skipped for c in cells.values() if c.skipped), None)
        if skipped:
            rows.append([str(L), f"skipped: {skipped}"])
            continue
        rows.append([str(L)] + [f"{cells[d].accuracy:.2f}" for d in depths]
                    + [f"{sum(c.correct for c in cells.values()) / sum(c.trials for c in cells.values()):.2f}"])
    return table(["context"] + [f"depth {d:g}" for d in depths] + ["mean"], rows)


def plot_passkey(report: PasskeyReport, path, *, title: str = "") -> None:
    """Accuracy against depth, one line per context length."""
    from lintime.evaluation.tasks.report import figure

    done = [c for c in report.cells if not c.skipped]
    with figure(path, title or f"passkey retrieval ({report.digits} digits)", "depth of the key in the context",
                "accuracy") as ax:
        for L in sorted({c.context_len for c in done}):
            pts = sorted((c.depth, c.accuracy) for c in done if c.context_len == L)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"context {L}")
        ax.set_ylim(-0.02, 1.02)


LM_EVAL_YAML = """\
# Passkey retrieval written by lintime.evaluation.tasks.passkey.write_lm_eval_task (offline: a local .jsonl).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
filter_list:
  - name: key
    filter:
      - function: regex
        regex_pattern: '^(\\d{{{digits}}})'
      - function: take_first
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


def write_lm_eval_task(
    folder,
    tokenizer,
    context_lens=(1024, 2048),
    depths=(0.0, 0.5, 1.0),
    *,
    trials: int = 10,
    digits: int = 5,
    seed: int = 0,
    corpus: str = "stdlib",
    task: str = "lintime_passkey",
) -> Path:
    """The prompts of :func:`evaluate_passkey` as an lm-evaluation-harness task: ``<task>.jsonl``
    (one ``{"prompt", "target", "context_len", "depth"}`` per trial; the prompt is the text after
    ``bos``) and ``<task>.yaml`` (``generate_until``, greedy, ``exact_match`` of the first
    ``digits`` generated characters against the key), in ``folder``.  Returns the YAML's path;
    run it with ``--include_path folder`` and ``add_bos_token=True`` (lintime's prompts start
    with ``bos``).  lm-eval re-tokenises the text, so a prompt whose filler was cut inside a
    character may differ by a token from lintime's own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lens = [int(L) for L in context_lens]
    stream = FillerStream(filler_text(corpus, min_chars=max(lens) * 8), tokenizer)
    rows = []
    for L in lens:
        for depth in depths:
            for t in range(trials):
                key, rng = trial_key(seed, L, depth, t, digits)
                ids = make_prompt(stream, tokenizer, L, depth, key, rng)
                rows.append({"prompt": tokenizer.decode(ids[1:]), "target": key, "context_len": L, "depth": depth})
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    yaml = folder / f"{task}.yaml"
    yaml.write_text(LM_EVAL_YAML.format(task=task, data=json.dumps(str(data.resolve())), max_tokens=digits + 4,
                                        digits=digits), encoding="utf-8")
    return yaml
