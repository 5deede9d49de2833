#!/usr/bin/env python3
"""Issue 43's quality-against-training-time study: the plan of runs and a resumable runner.

The plan (``plan()``; ``--list`` prints it with each run's estimated device time):

* **families** (:data:`FAMILIES`): FLASH (``flash-base``), Transformer++ (``transformer-pp-base``),
  GLA (``gla-base``), Transformer-VQ (``vq-base``): the seeds' ~110M configurations with the byte
  vocabulary (87-90M parameters), each with its seed's recipe (``lintime/training/config.py``:
  ``flash`` for FLASH and for its Transformer++ baseline, ``gla``, ``vq``) and the trainer's default,
  fastest exact path on CUDA (bf16 autocast, the training step in one CUDA graph, documents packed
  so that none sees another);
* **learning-rate sweep** (kind ``sweep``): at context 1024, seed 0, an adaptive ladder on the
  recipe's peak rate (:func:`sweep_ladder`): first x 0.5, 1 and 2 (:data:`LR_FACTORS`); while the
  family's best run (lowest final validation bits per byte; a rung that diverged counts as worse than
  any finished one) is at the ladder's top or bottom edge, the next rung out, x 2 or x 1/2 that edge's
  factor (ids ``sweep-<family>-1024-lrx4`` ...), within :data:`LR_FACTOR_RANGE`; the plan holds the
  rungs the records have called for so far (``plan(runs_dir=...)``), right after the family's first
  ones, so the scheduler runs them before any study run.  A family's study runs use its best rate and
  wait until the best is interior to the ladder or at the cap.  Sweep runs measure no retrieval
  (it is measured on the study runs);
* **study** (kind ``study``): contexts 1024, 4096, 8192 for every family and 32768 for every family
  (Transformer++ at 32k "as far as it fits": it needs several GPUs to finish in one call); seeds
  0, 1, 2 at 1024 and 8192, seed 0 elsewhere;
* **budget per run**: ``max(100M tokens, 1 epoch of the train split)``, never above 2 epochs;
  ``2^18`` tokens per optimiser step (the FLASH seed's batch), ``2^15`` per micro-batch;
  validation bits per byte 16 times per run (first 2^18 validation tokens, at the training
  context) against tokens and training wall time; at the end the validation **and test** bits per
  byte on the first 2^22 tokens of each split (whole documents, :func:`lintime.evaluation.evaluate`);
* **BPE part** (kind ``bpe``; issue 43 item 1: "per-token perplexity with a BPE tokenizer at one
  context, to compare with the seeds' tables"): every family at context 1024, seed 0, with
  lintime's byte-level BPE of 32,000 ids (:data:`BPE_VOCAB`: the base presets' own vocabulary size,
  and Transformer-VQ's PG-19 SentencePiece BPE) trained on the study corpus's train split
  (``lintime train --tokenizer bpe:32000``; deterministic, built once per call into
  ``data/cache-bpe32000/``), the family's swept rate, the
  same budget rule in BPE tokens: the train split is ~29.9M BPE tokens (3.75 bytes a token), so
  ``max(100M tokens, 1 epoch)`` is capped at 2 epochs (~59.5M tokens, 227 steps of 2^18); final
  validation and test per-token perplexity and bits per byte on the same documents as the byte
  runs' final scores (so its bits per byte compare with theirs); no retrieval.
* **retrieval** (issue 43 item 3, ``retrieval.py``): passkey and a multi-key needle at 1x / 2x / 4x
  the trained context on each study run's final model ("as trained", the record's ``retrieval``; the
  sweep and BPE runs skip it by the plan, :attr:`Run.no_retrieval_why`, and record why),
  then a **retrieval fine-tune**, the same for every family (:data:`RETRIEVAL_FT_STEPS` steps of the
  run's batch at its context, :data:`RETRIEVAL_FT_LR_FACTOR` x its peak rate, ``lintime train
  --init-from`` on a jsonl of train-split text and :data:`RETRIEVAL_FT_MIX` synthetic passkey /
  needle documents whose keys are never the evaluation's) and the same measurement again (the
  record's ``retrieval_ft``); each stage only when it fits the run's time budget, else recorded
  "not run" with the reason (``--no-retrieval`` skips both, ``--no-retrieval-ft`` the fine-tune).

Why whole runs per call: a base model's checkpoint with its optimiser state is ~1 GB, and files
that come back from a GPU call are size-limited and each call may land on a fresh machine, so a run
cannot be carried from one call to the next.  Each run therefore finishes inside one call: the
runner only starts a run whose estimated time fits the budget left (``--budget-s``), and a run that
one GPU cannot finish in one call (:data:`CALL_TRAIN_S` of training) is planned on ``gpus`` > 1
GPUs with DDP (the same global batch and schedule: the same run up to numerics), to be run on a
multi-GPU machine.  The report counts such a run's time as GPU-seconds (wall x GPUs) and marks it.
On a warm machine an interrupted run resumes from its last checkpoint in ``--work``
(``lintime train --resume``); elsewhere it starts over.

Records: one JSON per run in ``benchmarks/quality/runs/<id>.json`` (committed): status
(``done`` / ``incomplete`` / ``failed``; a failed one says whether its training ``diverged``), the
plan entry, the exact ``lintime train`` command, the commit, the device, seeds, tokens, context,
the validation curve (step, tokens, training seconds,
bits per byte; per-token loss and perplexity), the training-loss curve, the final validation and test
scores (bits per byte, per-token perplexity, the tokens, bytes and documents scored), timing; a BPE
run also its tokenizer (name, the cache's split counts, epochs).

Usage::

    python3 benchmarks/quality/run.py --list                       # the plan, what is done, device-time estimates,
                                                                   # each family's learning-rate ladder
    python3 benchmarks/quality/run.py --budget-s 540               # GPU call: unpack the corpus, run what fits
    python3 benchmarks/quality/run.py --budget-s 540 --only sweep  # only the learning-rate sweep (also: study, bpe,
                                                                   # a family, a run id, a context like 8192)
    python3 benchmarks/quality/run.py --smoke                      # the whole pipeline on a CPU in < 1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
for _p in (str(REPO), str(HERE)):  # lintime from this checkout; corpus.py beside this script
    if _p not in sys.path:
        sys.path.insert(0, _p)
RUNS = HERE / "runs"
DATA = HERE / "data"
WORK = HERE / "work"  # checkpoints (git-ignored; a warm machine resumes from them)
MANIFEST = HERE / "corpus_manifest.json"

MIN_TOKENS = 100_000_000
MAX_EPOCHS = 2.0
# 2^16 tokens a step, 1,716 steps a run: FLASH's x1 sweep run at 2^18 (the seed's batch, 429 steps) ended at 1.991
# validation bits per byte and the same run at 2^16 at 1.471, at the same tokens/s (benchmarks/quality/README.md)
TOKENS_PER_BATCH = 2**16
# a run's tokens are whole blocks of this many (the plan's first batch): every batch it has used divides them
TOKENS_QUANTUM = 2**18
MICRO_BATCH_TOKENS = 2**15
CURVE_POINTS = 16
CURVE_EVAL_TOKENS = 2**18
FINAL_EVAL_TOKENS = 2**22
SWEEP_CONTEXT = 1024
LR_FACTORS = (0.5, 1.0, 2.0)  # the sweep's first rungs, on the recipe's peak rate
# The adaptive ladder (sweep_ladder): while a family's best sweep run is at its ladder's top (bottom) edge, the next
# rung out is planned at LR_LADDER_STEP x (1 / LR_LADDER_STEP x) that edge's factor, as long as it stays within
# LR_FACTOR_RANGE.
LR_LADDER_STEP = 2.0
# 16x either way of the seed recipe's tuned rate: a best that far off says the recipe does not fit this setup (worth
# reporting, not chasing), and it bounds a family's sweep at 5 runs (~25 device-minutes)
LR_FACTOR_RANGE = (1 / 8, 8.0)
SEEDS_BY_CONTEXT = {1024: (0, 1, 2), 4096: (0,), 8192: (0, 1, 2), 32768: (0,)}
CALL_TRAIN_S = 420.0  # training seconds one 10-minute call leaves after start-up, unpacking, compiling, evaluation
START_S = 45.0  # per run: process start, model build, compile / graph capture (measured: 20-60 s on an H200)
EVAL_S = 20.0  # per run: the final validation + test scoring
# per run: passkey + multi-key needle at 1x / 2x / 4x the trained context (retrieval.py; 10 trials x 5 depths a
# length).  Reserved in the run's budget; what does not fit in it is recorded "not run", so the call still ends in time.
RETRIEVAL_S = 60.0
RETRIEVAL_TRIALS = 10  # per depth: x 5 depths = 50 prompts per length and task
RETRIEVAL_TOKENS_PER_S = 2e5  # the first cell's estimate (prompt tokens / s); later cells scale measured ones
# The retrieval fine-tune (after the "as trained" retrieval, the same for every family): the run's final model trained
# RETRIEVAL_FT_STEPS more steps of the run's batch (2^16 tokens: 8.4M tokens, ~7.5 % of the run) at the run's context
# with `lintime train --init-from`, on a mixture of the train split's text and synthetic passkey / needle documents
# (retrieval.fine_tune_documents: RETRIEVAL_FT_MIX of the tokens synthetic; keys / values / names never the
# evaluation's), at RETRIEVAL_FT_LR_FACTOR x the run's peak rate (warm-up RETRIEVAL_FT_WARMUP of the steps, then
# cosine to 0), a fresh optimiser; then retrieval again at 1x / 2x / 4x.  Its time (RETRIEVAL_FT_PREP_S to write and
# tokenise the documents + START_S + training + RETRIEVAL_S) is checked against the run's deadline before it starts;
# what does not fit is recorded "not run" with the reason.
RETRIEVAL_FT_STEPS = 128
RETRIEVAL_FT_MIX = 0.5
RETRIEVAL_FT_LR_FACTOR = 0.1
RETRIEVAL_FT_WARMUP = 0.125
RETRIEVAL_FT_PREP_S = 15.0  # read the train split, write the documents (8.4 MB), tokenise them

# The BPE part: every family at BPE_CONTEXT, seed 0, lintime's byte-level BPE of BPE_VOCAB ids trained on the train
# split (``lintime train --tokenizer bpe:32000``), the family's swept rate, the same budget rule in BPE tokens.
BPE_VOCAB = 32000
BPE_CONTEXT = 1024
BPE_SEEDS = (0,)
# The train split in that BPE, measured here 2026-12-02 (tokenizers 0.23.3, tokenizer bpe-32000-ac7092ed3bb3, the
# same with 1 and 2 threads; 112,034,957 bytes: 3.75 bytes a token): plans the budget (-> 2 epochs, 227 steps); the
# record keeps the counts of the cache the run used.
BPE_TRAIN_TOKENS = 29_859_740
BPE_TOKENIZER = "bpe-32000-ac7092ed3bb3"
# Training with 32,000 ids is slower than with bytes (the output layer): flash-base 476k tokens/s at 2k with 32,000
# ids (docs/results/bench_model.json) against 571k with the byte vocabulary; applied to every family's byte figure.
BPE_SLOWDOWN = 571 / 476
# Once per call with a BPE run: train the BPE (36 s on one core here) and tokenise the three splits (~80 s on two).
BPE_PREPARE_S = 120.0

# family -> (preset, recipe, the recipe's peak rate)
FAMILIES = {
    "flash": ("flash-base", "flash", 7e-4),
    "transformer-pp": ("transformer-pp-base", "flash", 7e-4),
    "gla": ("gla-base", "gla", 3e-4),
    "vq": ("vq-base", "vq", 4e-4),
}
# Training tokens/s on one H200 (byte vocabulary, 2^15 tokens per step, bf16, default path).  Measured
# (README, docs/performance.md, docs/results/train_default.json, 2026-12-01/02): flash-base 571k @2k,
# 564k @8k, 511k @32k; transformer-pp-base 388-428k @2k, ~310k @8k, ~150k @32k.  Estimated from
# docs/results/bench_model.json (vocabulary 32000, 2026-11-27), scaled by flash-base's byte/32k ratio
# (~1.1): gla-base ~500k-560k, vq-base ~410-450k (flat in T).  Used only to plan; the records hold
# what was measured.
THROUGHPUT = {
    "flash": {1024: 570e3, 2048: 570e3, 4096: 567e3, 8192: 564e3, 32768: 511e3},
    "transformer-pp": {1024: 430e3, 2048: 390e3, 4096: 350e3, 8192: 310e3, 32768: 150e3},
    "gla": {1024: 540e3, 2048: 540e3, 4096: 540e3, 8192: 540e3, 32768: 530e3},
    "vq": {1024: 440e3, 2048: 440e3, 4096: 440e3, 8192: 440e3, 32768: 440e3},
}
DDP_EFFICIENCY = 0.85  # assumed per-GPU efficiency of a DDP run (docs/distributed.md measures it)

SMOKE = {  # the --smoke pipeline: tiny presets, the smoke corpus, a few steps
    "families": {"flash": ("flash-tiny", "flash", 3e-3), "transformer-pp": ("transformer-pp-tiny", "flash", 3e-3)},
    "contexts": {128: (0,)}, "sweep_context": 128, "tokens": 8 * 1024, "tokens_per_batch": 1024,
    "micro": 1024, "curve_eval_tokens": 1024, "final_eval_tokens": 2048, "lr_factors": (0.5, 1.0),
    "lr_factor_range": (0.25, 2.0),  # one rung past either edge: the extension and the cap, in seconds
    "retrieval_trials": 1, "retrieval_depths": (0.0, 0.5, 1.0), "bpe_vocab": 512, "retrieval_ft_steps": 2,
}


@dataclasses.dataclass(frozen=True)
class Run:
    id: str
    kind: str  # sweep | study | bpe
    family: str
    preset: str
    recipe: str
    context: int
    seed: int
    lr: float | None  # None: the family's swept rate (resolved when the run starts)
    lr_factor: float | None  # sweep runs: the factor on the recipe's rate
    tokens: int
    tokens_per_batch: int
    micro_batch_tokens: int
    gpus: int  # GPUs it is planned on (DDP when > 1)
    est_s: float  # estimated training seconds on those GPUs
    curve_eval_tokens: int
    final_eval_tokens: int
    tokenizer: str = "byte"  # lintime train --tokenizer: byte, or bpe:<ids> (the bpe part)

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_batch)

    @property
    def init_seed(self) -> int:
        """Initial weights: the CRC-32 of the run id (no two runs share a draw; sweep runs of one family
        share it across rates, so the rate is the only difference)."""
        key = f"sweep-{self.family}-s{self.seed}" if self.kind == "sweep" else self.id
        return zlib.crc32(key.encode())

    @property
    def no_retrieval_why(self) -> str | None:
        """Why the plan measures no retrieval (as trained or fine-tuned) on this run; ``None``: it does."""
        if self.kind == "bpe":
            return "BPE run: retrieval is measured on the byte runs"
        if self.kind == "sweep":
            return "sweep run: retrieval is measured on the study runs"
        return None

    @property
    def retrieval_s(self) -> float:
        """Seconds reserved for retrieval after the scoring: none where the plan skips it (:attr:`no_retrieval_why`)."""
        return 0.0 if self.no_retrieval_why else RETRIEVAL_S

    @property
    def smoke(self) -> bool:
        return self.tokens_per_batch == SMOKE["tokens_per_batch"]

    @property
    def ft_steps(self) -> int:
        return SMOKE["retrieval_ft_steps"] if self.smoke else RETRIEVAL_FT_STEPS

    @property
    def ft_tokens(self) -> int:
        """Training tokens of the retrieval fine-tune (0 where the plan skips retrieval: the sweep and BPE runs)."""
        return 0 if self.no_retrieval_why else self.ft_steps * self.tokens_per_batch

    @property
    def retrieval_ft_s(self) -> float:
        """Estimated seconds of the retrieval fine-tune stage on the run's GPUs (documents, start-up, training at
        the planned rate, retrieval again); 0 where the plan skips retrieval (the sweep and BPE runs)."""
        if self.no_retrieval_why:
            return 0.0
        return RETRIEVAL_FT_PREP_S + START_S + self.est_s * self.ft_tokens / self.tokens + RETRIEVAL_S

    @property
    def est_device_s(self) -> float:
        """Device seconds of the run without the retrieval fine-tune (which is done only when time is left)."""
        return self.gpus * (self.est_s + START_S + EVAL_S + self.retrieval_s)

    @property
    def est_ft_device_s(self) -> float:
        return self.gpus * self.retrieval_ft_s


def corpus_train_tokens(manifest: Path = MANIFEST) -> int | None:
    try:
        return int(json.loads(manifest.read_text())["splits"]["train"]["tokens"])
    except (OSError, KeyError, ValueError):
        return None


def run_tokens(train_tokens: int | None) -> int:
    """``max(100M, 1 epoch)``, capped at 2 epochs, in whole :data:`TOKENS_QUANTUM` blocks (so whole optimiser steps;
    rounded up, but never above 2 epochs).
    ``train_tokens``: the train split in the run's tokens (bytes; BPE tokens for the bpe part)."""
    t = MIN_TOKENS if train_tokens is None else max(MIN_TOKENS, train_tokens)
    if train_tokens is not None:
        t = min(t, int(MAX_EPOCHS * train_tokens))
    blocks = math.ceil(t / TOKENS_QUANTUM)
    if train_tokens is not None and blocks * TOKENS_QUANTUM > MAX_EPOCHS * train_tokens:
        blocks -= 1  # never above 2 epochs
    return blocks * TOKENS_QUANTUM


def plan(smoke: bool = False, train_tokens: int | None = None, bpe_train_tokens: int | None = None,
         runs_dir: Path | None = None) -> list[Run]:
    """Every run of the study, in the order they are run: the sweep first (it decides the study's
    rates), then seed 0 of every (context, family) -- short contexts first --, then the BPE part,
    then the other seeds.  ``train_tokens`` / ``bpe_train_tokens``: the train split in bytes / in
    BPE tokens (default: the corpus manifest's / :data:`BPE_TRAIN_TOKENS`).  ``runs_dir``: the run
    records; with them, each family's sweep also holds the rungs its adaptive ladder has called for so
    far (:func:`sweep_ladder`), right after its first ones; without them, the fixed plan."""
    if smoke:
        s = SMOKE
        fams, contexts, sweep_ctx, factors = s["families"], s["contexts"], s["sweep_context"], s["lr_factors"]
        tokens, tpb, micro, cur, fin = s["tokens"], s["tokens_per_batch"], s["micro"], s["curve_eval_tokens"], \
            s["final_eval_tokens"]
        bpe_tokens, bpe_spec, bpe_ctx, bpe_seeds = tokens, f"bpe:{s['bpe_vocab']}", sweep_ctx, (0,)
    else:
        fams, contexts, sweep_ctx, factors = FAMILIES, SEEDS_BY_CONTEXT, SWEEP_CONTEXT, LR_FACTORS
        tokens = run_tokens(train_tokens if train_tokens is not None else corpus_train_tokens())
        tpb, micro, cur, fin = TOKENS_PER_BATCH, MICRO_BATCH_TOKENS, CURVE_EVAL_TOKENS, FINAL_EVAL_TOKENS
        bpe_tokens = run_tokens(bpe_train_tokens if bpe_train_tokens is not None else BPE_TRAIN_TOKENS)
        bpe_spec, bpe_ctx, bpe_seeds = f"bpe:{BPE_VOCAB}", BPE_CONTEXT, BPE_SEEDS

    def make(kind, fam, ctx, seed, lr, factor, rid, n_tokens=tokens, tokenizer="byte"):
        preset, recipe, _ = fams[fam]
        if smoke:
            gpus, est = 1, 5.0
        else:
            one = n_tokens / (THROUGHPUT[fam][ctx] / (BPE_SLOWDOWN if tokenizer != "byte" else 1.0))
            gpus = 1
            while one / (gpus * (DDP_EFFICIENCY if gpus > 1 else 1.0)) > CALL_TRAIN_S and gpus < 8:
                gpus *= 2
            est = one / (gpus * (DDP_EFFICIENCY if gpus > 1 else 1.0))
        return Run(rid, kind, fam, preset, recipe, ctx, seed, lr, factor, n_tokens, tpb, min(micro, tpb), gpus, est,
                   cur, fin, tokenizer)

    runs = []
    for fam, (_, _, base_lr) in fams.items():
        first = [make("sweep", fam, sweep_ctx, 0, base_lr * f, f, sweep_id(fam, sweep_ctx, f)) for f in factors]
        ladder = sweep_ladder(fam, first, runs_dir) if runs_dir is not None else None
        runs += first + ([r for r in ladder.order if r not in first] if ladder else [])
    for seed_rank in (0, 1):
        for ctx, seeds in contexts.items():
            for seed in seeds:
                if (seed == 0) != (seed_rank == 0):
                    continue
                for fam in fams:
                    runs.append(make("study", fam, ctx, seed, None, None, f"{fam}-{ctx}-s{seed}"))
        if seed_rank == 0:
            for seed in bpe_seeds:
                for fam in fams:
                    runs.append(make("bpe", fam, bpe_ctx, seed, None, None, f"bpe-{fam}-{bpe_ctx}-s{seed}",
                                     n_tokens=bpe_tokens, tokenizer=bpe_spec))
    return runs


def sweep_id(family: str, context: int, factor: float) -> str:
    return f"sweep-{family}-{context}-lrx{factor:g}"


def ladder_rule(smoke: bool) -> tuple[tuple[float, ...], tuple[float, float]]:
    """The sweep's first factors and the ladder's cap ``(lowest, highest factor)``."""
    if smoke:
        return SMOKE["lr_factors"], SMOKE["lr_factor_range"]
    return LR_FACTORS, LR_FACTOR_RANGE


def cache_dir(run: Run, data: Path) -> Path:
    """The run's token cache: ``data/cache`` (bytes, built by corpus.py) or ``data/cache-bpe<ids>``."""
    return data / "cache" if run.tokenizer == "byte" else data / f"cache-{run.tokenizer.replace(':', '')}"


def bpe_cache_ready(run: Run, data: Path) -> bool:
    c = cache_dir(run, data)
    return all((c / f"{s}.bin").exists() for s in ("train", "validation", "test")) and any(c.glob("tokenizer-*"))


def ensure_bpe(run: Run, data: Path, quiet: bool = True) -> dict:
    """The BPE run's tokenizer and cache (every split), built once (``lintime.data.prepare``, exactly what
    ``lintime train`` calls, so the trainer reuses it) or reused; ``{"name", "splits": {split: {docs, tokens,
    bytes}}}``."""
    from lintime.data import prepare

    out = prepare(str(data / "corpus"), run.tokenizer, cache_dir(run, data), quiet=quiet)
    return {"spec": run.tokenizer, "name": out["train"].tokenizer.name,
            "splits": {s: {"docs": len(ds), "tokens": int(ds.n_tokens), "bytes": int(ds.n_bytes)}
                       for s, ds in out.items()}}


# ------------------------------------------------------------------------------------------- records


def record_path(run: Run, runs_dir: Path) -> Path:
    return runs_dir / f"{run.id}.json"


def read_record(run: Run, runs_dir: Path) -> dict | None:
    p = record_path(run, runs_dir)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def write_record(run: Run, runs_dir: Path, rec: dict) -> None:
    runs_dir.mkdir(parents=True, exist_ok=True)
    p = record_path(run, runs_dir)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(p)


def is_done(run: Run, runs_dir: Path) -> bool:
    rec = read_record(run, runs_dir)
    return bool(rec) and rec.get("status") == "done"


def diverged(rec: dict | None) -> bool:
    """The run ended without a finite validation score: training diverged (lintime train stops with "training
    diverged"), or it finished with a non-finite final score."""
    if not rec:
        return False
    if rec.get("status") == "failed":
        return bool(rec.get("diverged")) or "training diverged" in (rec.get("error") or "")
    if rec.get("status") == "done":
        v = (rec.get("final") or {}).get("validation_bpb")
        return not isinstance(v, (int, float)) or not math.isfinite(v)
    return False


def settled(run: Run, runs_dir: Path) -> bool:
    """Nothing more to run: done, or a sweep rung that diverged (the ladder counts it as worse than any finished rung;
    a rerun would diverge again).  Any other failure is run again."""
    rec = read_record(run, runs_dir)
    return bool(rec) and (rec.get("status") == "done" or (run.kind == "sweep" and diverged(rec)))


@dataclasses.dataclass(frozen=True)
class Ladder:
    """A family's learning-rate sweep (:func:`sweep_ladder`)."""

    rungs: tuple[Run, ...]  # lowest factor first: the first rungs and those the records have called for so far
    order: tuple[Run, ...]  # the same runs in plan order: the first rungs, then each extension as it was called for
    best: Run | None  # the chosen rung; None while the study waits, or when no rung has a finite score
    state: str  # "interior" | "at the cap" | "waits" | "no score"
    why: str
    waiting: tuple[Run, ...] = ()  # rungs not yet ended (state "waits")


def _rung(edge: Run, factor: float) -> Run:
    """The sweep run of ``edge``'s family at ``factor`` x the recipe's rate (otherwise ``edge``'s run)."""
    base = (SMOKE["families"] if edge.smoke else FAMILIES)[edge.family][2]
    return dataclasses.replace(edge, id=sweep_id(edge.family, edge.context, factor), lr=base * factor,
                               lr_factor=factor)


def sweep_ladder(family: str, runs: list[Run], records: Path | dict[str, dict]) -> Ladder:
    """The family's sweep as the records make it (``records``: the runs folder, or ``{run id: record}``).

    Adaptive ladder: once every rung has ended, the best is the rung with the lowest final validation bits per byte;
    a rung that diverged or ended without a finite score counts as worse than any finished one, so it also stops the
    ladder on its side.  A best at the ladder's top (bottom) edge calls for the next rung out, :data:`LR_LADDER_STEP`
    x (1 / that) the edge's factor, and the family's study waits for it; the ladder ends when the best is interior, or
    at an edge whose next rung would leave the cap (:data:`LR_FACTOR_RANGE`; the smoke's ``lr_factor_range``).  A rung
    with a record (on the ladder's grid, within the cap) is on it from the start."""
    rungs = sorted((r for r in runs if r.kind == "sweep" and r.family == family), key=lambda r: r.lr_factor)
    if not rungs:
        return Ladder((), (), None, "no score", f"no sweep run of {family} in the plan")
    order = [r for r in runs if r in rungs]
    start, (lo, hi) = ladder_rule(rungs[0].smoke)
    cap = f"x{lo:g}-x{hi:g}"

    def rec_of(r: Run) -> dict | None:
        return read_record(r, records) if isinstance(records, Path) else records.get(r.id)

    # a rung with a record is on the ladder even while a first rung still waits (its run is done, and shows)
    known = {r.lr_factor for r in rungs}
    ran = sorted({f for f in (lo * LR_LADDER_STEP ** k for k in range(round(math.log(hi / lo, LR_LADDER_STEP)) + 1))
                  if f not in known and rec_of(_rung(rungs[0], f))})
    if ran:
        extra = [_rung(rungs[0], f) for f in ran]
        rungs, order = sorted(rungs + extra, key=lambda r: r.lr_factor), order + extra

    while True:
        recs = {r.id: rec_of(r) for r in rungs}
        ended = [r for r in rungs if (recs[r.id] or {}).get("status") == "done" or diverged(recs[r.id])]
        score = {r.id: math.inf if diverged(recs[r.id]) else recs[r.id]["final"]["validation_bpb"] for r in ended}
        waiting = [r for r in rungs if r not in ended]
        if waiting:
            why = "waits for the learning-rate sweep (" + ", ".join(
                f"{r.id} {(recs[r.id] or {}).get('status', 'not run')}" for r in waiting) + ")"
            if ended and any(r.lr_factor not in start for r in waiting):  # an extension rung: say why it is there
                prev = min(ended, key=lambda r: score[r.id])
                side = "top" if waiting[-1].lr_factor > prev.lr_factor else "bottom"
                why += f"; the best so far, x{prev.lr_factor:g}, is at the {side} edge of the ended rungs"
            return Ladder(tuple(rungs), tuple(order), None, "waits", why, tuple(waiting))
        if all(math.isinf(v) for v in score.values()):
            return Ladder(tuple(rungs), tuple(order), None, "no score",
                          f"no sweep run of {family} ended with a finite validation score: no rate to choose")
        best = min(rungs, key=lambda r: score[r.id])  # a tie: the lower rate
        i = rungs.index(best)
        new = []
        if i == len(rungs) - 1 and best.lr_factor * LR_LADDER_STEP <= hi * (1 + 1e-9):
            new.append(_rung(best, best.lr_factor * LR_LADDER_STEP))
        if i == 0 and best.lr_factor / LR_LADDER_STEP >= lo * (1 - 1e-9):
            new.append(_rung(best, best.lr_factor / LR_LADDER_STEP))
        if not new:
            break
        rungs = sorted(rungs + new, key=lambda r: r.lr_factor)
        order += new
    head = f"swept at context {best.context}: {best.id} (x{best.lr_factor:g}, "
    bad = [f"x{r.lr_factor:g}" for r in rungs if math.isinf(score[r.id])]
    tail = f"; {', '.join(bad)} diverged or ended without a finite score: worse than any finished rung)" if bad else ")"
    if 0 < i < len(rungs) - 1:
        return Ladder(tuple(rungs), tuple(order), best, "interior",
                      head + f"interior: the rungs either side score worse; ladder {cap}" + tail)
    return Ladder(tuple(rungs), tuple(order), best, "at the cap",
                  head + f"at the cap: the next rung out would leave the ladder's {cap}" + tail)


def swept_lr(family: str, runs: list[Run], runs_dir: Path) -> tuple[float | None, str]:
    """The family's rate: the best rung of its sweep's adaptive ladder (:func:`sweep_ladder`) once the best is
    interior or at the cap; ``(None, why)`` before that (its sweep runs, or the next rung out, not done yet)."""
    ladder = sweep_ladder(family, runs, runs_dir)
    return (ladder.best.lr if ladder.best else None), ladder.why


def git_commit() -> str | None:
    env = os.environ.get("LINTIME_GIT_COMMIT")
    if env:
        return env
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "host_cpus": os.cpu_count(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["visible_gpus"] = torch.cuda.device_count()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


# ------------------------------------------------------------------------------------------- one run



def train_head(gpus: int) -> tuple[list[str], list[str]]:
    """``(the command that starts lintime train, its extra flags)``: one process, or ``gpus`` DDP ranks by torchrun."""
    if gpus > 1:
        return ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                 "-m", "lintime", "train"], ["--parallel", "ddp"])
    return [sys.executable, "-m", "lintime", "train"], []


def train_command(run: Run, lr: float, *, data: Path, work: Path, device: str, time_min: float | None,
                  resume: bool, gpus: int) -> list[str]:
    eval_every = max(1, run.steps // CURVE_POINTS)
    args = ["--preset", run.preset, "--corpus", str(data / "corpus"), "--cache-dir", str(cache_dir(run, data)),
            "--tokenizer", run.tokenizer,
            "--context-len", str(run.context), "--tokens-per-batch", str(run.tokens_per_batch),
            "--micro-batch-tokens", str(run.micro_batch_tokens), "--tokens", str(run.tokens),
            "--recipe", run.recipe, "--lr", f"{lr:.6g}", "--seed", str(run.seed), "--init-seed", str(run.init_seed),
            "--device", device, "--log-every", "1", "--eval-every", str(eval_every),
            "--eval-tokens", str(run.curve_eval_tokens), "--save-every", str(max(1, run.steps // 4)), "--keep", "1",
            "--no-plots", "--sample-tokens", "0", "--no-progress", "--out", str(work), "--name", run.id]
    if time_min is not None:
        args += ["--time", f"{time_min:.3f}"]
    head, extra = train_head(gpus)
    args += extra
    if resume:  # the saved config; only the budget and the device may differ
        args = ["--resume", str(work / run.id), "--device", device] + (
            ["--time", f"{time_min:.3f}"] if time_min is not None else [])
    return head + args


def read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def same_documents_tokens(ds, byte_ds, max_tokens: int) -> int:
    """``max_tokens`` for ``ds`` (a split in another tokenizer) that selects the same documents as
    ``max_tokens`` selects in ``byte_ds`` (the byte runs' final scores: the first whole documents whose
    targets reach ``max_tokens``): ``evaluate`` then scores the same text in both."""
    from lintime.evaluation.lm import select_documents

    if len(ds) != len(byte_ds):
        raise ValueError(f"the two caches hold different documents ({len(ds)} and {len(byte_ds)})")
    n_docs = select_documents(byte_ds, max_tokens)
    return int((ds.doc_lengths[:n_docs] + 1).sum())


def split_scores(report) -> dict:
    """A record's scores from one split's :class:`lintime.evaluation.EvalReport` (one context): bits per
    byte (the summed loss over the text's UTF-8 bytes), per-token perplexity ``exp(loss)`` and bits per token
    (``loss / ln 2``), with the counts they come from (``bits_per_byte = bits_per_token * targets / bytes``)."""
    r = report.results[0]
    return {"bpb": r.bits_per_byte, "perplexity": r.perplexity, "bits_per_token": r.bits_per_token,
            "targets": r.n_targets, "bytes": report.n_bytes, "docs": report.n_docs}


def final_scores(run_dir: Path, run: Run, device: str, loaded=None, *, byte_cache: Path | None = None) -> dict:
    """Validation and test scores of the run's last checkpoint at its training context: bits per byte (and,
    for every tokenizer, per-token perplexity).  A BPE run (``byte_cache``: the byte runs' cache) is scored on
    the same documents as the byte runs."""
    import torch

    from lintime.data import open_prepared
    from lintime.evaluation import evaluate
    from lintime.training.checkpoint import load_model

    loaded = loaded or load_model(run_dir, device=device)
    amp = torch.bfloat16 if device.startswith("cuda") else None
    out = {"n_params": loaded.model.num_parameters(), "eval_tokens": run.final_eval_tokens,
           "context": run.context, "tokenizer": loaded.tokenizer.name}
    cache = Path(json.loads((run_dir / "config.json").read_text())["train"]["cache_dir"])
    for split in ("validation", "test"):
        ds = open_prepared(cache, split, loaded.tokenizer)
        max_tokens = run.final_eval_tokens
        if byte_cache is not None:
            max_tokens = same_documents_tokens(ds, open_prepared(byte_cache, split), run.final_eval_tokens)
        rep = evaluate(loaded.model, ds, [run.context], tokenizer=loaded.tokenizer,
                       max_tokens=max_tokens, batch_tokens=max(4 * run.context, 32768), autocast=amp)
        for key, value in split_scores(rep).items():
            out[f"{split}_{key}"] = value
    return out


def retrieval_scores(loaded, run: Run, device: str, *, data: Path, deadline: float, log: Path | None = None) -> dict:
    """Passkey and the multi-key needle (``retrieval.py``) at 1x / 2x / 4x the run's context on its
    final model, the filler from the study corpus's test split; cells that would end past
    ``deadline`` (a ``time.monotonic()`` time) are recorded "not run"."""
    import torch

    import retrieval  # noqa: PLC0415 - beside this script

    smoke = run.tokens_per_batch == SMOKE["tokens_per_batch"]
    trials = SMOKE["retrieval_trials"] if smoke else RETRIEVAL_TRIALS
    depths = SMOKE["retrieval_depths"] if smoke else retrieval.DEPTHS
    first = None if device == "cpu" else trials * len(depths) * run.context / RETRIEVAL_TOKENS_PER_S + 5.0

    def say(msg: str) -> None:
        if log is not None:
            with open(log, "a") as f:
                print(msg, file=f, flush=True)

    return retrieval.measure(loaded.model, loaded.tokenizer, run.context, corpus=str(data / "corpus"),
                             deadline=deadline, trials=trials, depths=depths, seed=run.seed,
                             autocast=torch.bfloat16 if device.startswith("cuda") else None,
                             first_estimate_s=first, say=say)


def invoke(cmd: list[str], log: Path, in_process: bool = False) -> subprocess.CompletedProcess:
    """Run a ``lintime`` command, its output appended to ``log``; ``in_process`` (the CPU smoke): through lintime's
    CLI entry in this interpreter."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "a") as f:
        print(f"$ {shlex.join(cmd)}", file=f, flush=True)
        if in_process:  # the CPU smoke: the same command through lintime's CLI entry, without a second interpreter
            import contextlib

            from lintime.cli import main as lintime_main

            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                try:
                    rc = lintime_main(cmd[cmd.index("lintime") + 1:])
                except SystemExit as exit_:
                    rc = exit_.code if isinstance(exit_.code, int) else 1
            return subprocess.CompletedProcess(cmd, rc or 0)
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)


# ------------------------------------------------------------------------------------------- retrieval fine-tune


def ft_settings(run: Run, lr: float) -> dict:
    """What the retrieval fine-tune of ``run`` (trained at peak rate ``lr``) is: the same for every family."""
    return {"steps": run.ft_steps, "tokens": run.ft_tokens, "tokens_per_batch": run.tokens_per_batch,
            "context": run.context, "mix": RETRIEVAL_FT_MIX, "lr_factor": RETRIEVAL_FT_LR_FACTOR,
            "lr": lr * RETRIEVAL_FT_LR_FACTOR, "warmup": RETRIEVAL_FT_WARMUP, "decay": "cosine", "final_lr_ratio": 0.0,
            "recipe": run.recipe, "init_from": "the run's final checkpoint (weights; a fresh optimiser)",
            "data": "the study corpus's train split + synthetic passkey / needle documents (retrieval.py), "
                    "keys / values / names never the evaluation's"}


def ft_need_s(run: Run, rec: dict, device: str, after_1x_s: float | None = None) -> tuple[float, dict]:
    """Seconds the retrieval fine-tune stage needs, and its parts: writing and tokenising the documents, start-up,
    training (at the run's measured tokens/s when its record has it, else the plan's), and retrieval at 1x after it
    (``after_1x_s``: from the "as trained" 1x cells when measured, else the first cells' planned estimate)."""
    cuda = device.startswith("cuda")
    tps = (rec.get("timing") or {}).get("tokens_per_s")
    train = run.ft_tokens / tps if tps else run.est_s * run.ft_tokens / run.tokens
    if after_1x_s is None:
        after_1x_s = 2 * (run_trials(run) * len(run_depths(run)) * run.context / RETRIEVAL_TOKENS_PER_S + 5.0) \
            if cuda else 2.0
    parts = {"documents_s": RETRIEVAL_FT_PREP_S if cuda else 2.0, "start_s": START_S if cuda else 5.0,
             "train_s": train, "retrieval_1x_s": after_1x_s}
    return sum(parts.values()), {k: round(v, 1) for k, v in parts.items()}


def run_trials(run: Run) -> int:
    return SMOKE["retrieval_trials"] if run.smoke else RETRIEVAL_TRIALS


def run_depths(run: Run) -> tuple:
    import retrieval  # noqa: PLC0415 - beside this script

    return SMOKE["retrieval_depths"] if run.smoke else retrieval.DEPTHS


def ft_documents_file(run: Run, corpus: Path, folder: Path) -> tuple[Path, dict]:
    """Write the fine-tune's documents (``retrieval.fine_tune_documents``) as ``folder/retrieval_ft.jsonl``: enough
    train-split records (lintime's hash rule splits a jsonl's records too, ~90 % train) for the steps' rows, and at
    least one validation record (the trainer validates at its end)."""
    import retrieval  # noqa: PLC0415 - beside this script

    from lintime.data.corpus import split_of

    name = "retrieval_ft.jsonl"
    rows = math.ceil(run.ft_tokens / run.context)
    n = max(64, math.ceil(rows / 0.9 * 1.05) + 8)
    while True:
        splits = [split_of(f"{name}#{i}") for i in range(1, n + 1)]
        if splits.count("train") >= rows and "validation" in splits:
            break
        n += 16
    docs, summary = retrieval.fine_tune_documents(str(corpus), run.context, n, mix=RETRIEVAL_FT_MIX, seed=run.seed,
                                                  eval_multiples=retrieval.MULTIPLES, eval_depths=run_depths(run),
                                                  eval_trials=run_trials(run))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    summary["train_records"] = splits.count("train")
    summary["bytes"] = path.stat().st_size
    return path, summary


def ft_command(run: Run, lr: float, *, jsonl: Path, cache: Path, src: Path, work: Path, device: str,
               time_min: float | None, gpus: int) -> list[str]:
    """``lintime train --init-from`` the run's folder on the fine-tune's documents (:func:`ft_settings`)."""
    st = ft_settings(run, lr)
    args = ["--init-from", str(src), "--preset", run.preset, "--tokenizer", run.tokenizer, "--corpus", str(jsonl),
            "--cache-dir", str(cache), "--context-len", str(run.context),
            "--tokens-per-batch", str(run.tokens_per_batch), "--micro-batch-tokens", str(run.micro_batch_tokens),
            "--steps", str(run.ft_steps), "--recipe", run.recipe, "--lr", f"{st['lr']:.6g}",
            "--warmup", f"{st['warmup']:g}", "--decay", st["decay"], "--final-lr-ratio", f"{st['final_lr_ratio']:g}",
            "--seed", str(run.seed), "--device", device, "--log-every", "1", "--eval-every", "0",
            "--eval-tokens", str(4 * run.context), "--save-every", "0", "--keep", "1", "--no-plots",
            "--sample-tokens", "0", "--no-progress", "--out", str(work), "--name", f"{run.id}-rft"]
    if time_min is not None:
        args += ["--time", f"{time_min:.3f}"]
    head, extra = train_head(gpus)
    args += extra
    return head + args


def ft_not_run(run: Run, lr: float | None, why: str, **extra) -> dict:
    import retrieval  # noqa: PLC0415 - beside this script

    out = {"status": "not run", "why": why}
    if lr is not None:
        out["settings"] = ft_settings(run, lr)
    out.update(extra)
    out["retrieval"] = retrieval.not_run(run.context, f"retrieval fine-tune not run: {why}")
    return out


def retrieval_fine_tune(run: Run, lr: float, rec: dict, *, data: Path, work: Path, device: str, gpus: int,
                        deadline: float, log: Path, in_process: bool = False) -> dict:
    """The record's ``retrieval_ft``: fine-tune the run's final checkpoint (``work/<id>``) for ``run.ft_steps`` steps on
    the mixed documents with ``lintime train --init-from``, then passkey / needle at 1x / 2x / 4x on that model.
    Skipped ("not run", with the reason) when its estimate (:func:`ft_need_s`) does not end before ``deadline`` (a
    ``time.monotonic()`` time); the fine-tuned checkpoint and the documents are deleted afterwards."""
    import retrieval  # noqa: PLC0415 - beside this script

    t0 = time.monotonic()
    as_1x = sum(c.get("seconds") or 0.0 for c in (rec.get("retrieval") or {}).get("cells", [])
                if c.get("multiple") == 1 and c.get("status") == "done")
    need, parts = ft_need_s(run, rec, device, after_1x_s=as_1x * 1.3 if as_1x else None)
    left = deadline - t0
    if need > left:
        return ft_not_run(run, lr, f"needs ~{need:.0f} s ({', '.join(f'{k} {v:g}' for k, v in parts.items())}), "
                                   f"{max(left, 0):.0f} s left", estimate_s=parts)
    ft_dir, folder = work / f"{run.id}-rft", work / f"{run.id}-rft-data"
    out = {"status": "failed", "settings": ft_settings(run, lr), "estimate_s": parts}
    try:
        for d in (ft_dir, folder):
            shutil.rmtree(d, ignore_errors=True)
        jsonl, out["documents"] = ft_documents_file(run, data / "corpus", folder)
        out["documents_s"] = time.monotonic() - t0
        train_left = deadline - time.monotonic() - parts["retrieval_1x_s"] - (5.0 if device == "cpu" else START_S)
        cmd = ft_command(run, lr, jsonl=jsonl, cache=folder / "cache", src=work / run.id, work=work, device=device,
                         time_min=max(train_left, 1.0) / 60, gpus=gpus)
        out["command"] = shlex.join(cmd)
        t1 = time.monotonic()
        proc = invoke(cmd, log, in_process)
        rows = [r for r in read_metrics(ft_dir) if r.get("loss") is not None]
        steps_done = max((int(r["step"]) for r in rows), default=0)
        out["train"] = {"wall_s": time.monotonic() - t1, "rc": proc.returncode, "steps_done": steps_done,
                        "tokens": rows[-1]["tokens"] if rows else 0,
                        "first_loss": rows[0]["loss"] if rows else None, "last_loss": rows[-1]["loss"] if rows else None,
                        "train_s": rows[-1]["time_s"] if rows else None}
        if proc.returncode != 0:
            out["why"] = f"lintime train exited {proc.returncode}: {_tail(log, 600)}"
            out["retrieval"] = retrieval.not_run(run.context, "retrieval fine-tune failed")
        elif steps_done < run.ft_steps:
            out.update(status="incomplete", why=f"{steps_done} of {run.ft_steps} steps in the time left")
            out["retrieval"] = retrieval.not_run(run.context, "retrieval fine-tune incomplete")
        else:
            from lintime.training.checkpoint import load_model

            loaded = load_model(ft_dir, device=device)
            out["retrieval"] = retrieval_scores(loaded, run, device, data=data, deadline=deadline, log=log)
            out["status"] = "done"
            del loaded
    except Exception as err:  # noqa: BLE001 - the run's scores stand; the record says why
        out.update(status="failed", why=f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
        out.setdefault("retrieval", retrieval.not_run(run.context, "retrieval fine-tune failed"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get("QUALITY_KEEP_CHECKPOINTS") != "1":
            shutil.rmtree(ft_dir, ignore_errors=True)
        retrieval._free_memory()
    out["seconds"] = time.monotonic() - t0
    return out


def run_one(run: Run, lr: float, lr_source: str, *, data: Path, work: Path, runs_dir: Path, device: str,
            time_budget_s: float, gpus: int, log: Path, in_process: bool = False, retrieval: bool = True,
            retrieval_ft: bool = True) -> dict:
    """Train ``run`` (resuming a checkpoint in ``work`` when there is one), score it, measure
    retrieval on it (unless ``retrieval`` is False or the plan skips it: :attr:`Run.no_retrieval_why`),
    fine-tune it for retrieval and measure again (unless ``retrieval`` or ``retrieval_ft`` is False, or it
    does not fit), write its record; all inside ``time_budget_s``."""
    t_start = time.monotonic()
    run_dir = work / run.id
    resume = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    retrieval = retrieval and not run.no_retrieval_why
    train_s = max(time_budget_s - START_S - EVAL_S - (run.retrieval_s if retrieval else 0.0), 5.0)
    cmd = train_command(run, lr, data=data, work=work, device=device, time_min=train_s / 60, resume=resume, gpus=gpus)
    rec = read_record(run, runs_dir) or {}
    slices = rec.get("slices", [])
    rec.pop("diverged", None)  # an earlier slice's
    rec.update({"id": run.id, "status": "running", "run": dataclasses.asdict(run) | {"steps": run.steps},
                "lr": lr, "lr_source": lr_source, "commit": git_commit(), "environment": environment(device),
                "gpus": gpus, "corpus": _corpus_summary(manifest_of(data, run))})
    if not resume:
        rec["command"] = shlex.join(cmd)
        if run_dir.exists():
            shutil.rmtree(run_dir)
    t0 = time.time()
    proc = invoke(cmd, log, in_process)
    rows = read_metrics(run_dir)
    steps_done = max((int(r["step"]) for r in rows), default=0)
    slices.append({"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)), "wall_s": time.time() - t0,
                   "resumed": resume, "rc": proc.returncode, "step_end": steps_done,
                   "device": rec["environment"].get("device_name", device), "gpus": gpus})
    rec["slices"] = slices
    rec.update(curves(rows))
    if proc.returncode != 0:
        rec["status"] = "failed"
        rec["error"] = _tail(log)
        rec["diverged"] = "training diverged" in rec["error"]  # lintime train's message (see diverged())
    elif steps_done < run.steps:
        rec["status"] = "incomplete"
    else:
        try:
            from lintime.training.checkpoint import load_model

            loaded = load_model(run_dir, device=device)
            rec["final"] = final_scores(run_dir, run, device, loaded,
                                        byte_cache=None if run.tokenizer == "byte" else data / "cache")
            rec["status"] = "done"
            rec["tokens"] = rows[-1]["tokens"] if rows else None
        except Exception as err:  # noqa: BLE001 - the record says why
            rec["status"] = "failed"
            rec["error"] = f"final scoring: {type(err).__name__}: {err}"
        if rec["status"] == "done":  # before the checkpoint goes: it cannot come back from the GPU machine
            import retrieval as retrieval_mod  # noqa: PLC0415 - beside this script

            end = t_start + time_budget_s - 5.0
            if run.no_retrieval_why:  # by the plan (a sweep or BPE run)
                rec["retrieval"] = retrieval_mod.not_run(run.context, run.no_retrieval_why)
                rec["retrieval_ft"] = ft_not_run(run, None, run.no_retrieval_why)
            elif not retrieval:
                rec["retrieval"] = retrieval_mod.not_run(run.context, "--no-retrieval")
                rec["retrieval_ft"] = ft_not_run(run, lr, "--no-retrieval")
            else:
                # the fine-tune's time is held back from the "as trained" 2x / 4x cells when both it and the 1x cells
                # fit (the bar is judged after the fine-tune); otherwise the as-trained cells take it all
                need, parts = ft_need_s(run, rec, device)
                hold = need if retrieval_ft and end - time.monotonic() >= need + parts["retrieval_1x_s"] else 0.0
                try:
                    rec["retrieval"] = retrieval_scores(loaded, run, device, data=data, log=log, deadline=end - hold)
                except Exception as err:  # noqa: BLE001 - the run's scores stand; the record says why
                    rec["retrieval"] = retrieval_mod.not_run(run.context, f"failed: {type(err).__name__}: {err}")
            del loaded
            retrieval_mod._free_memory()
            if retrieval:
                if not retrieval_ft:
                    rec["retrieval_ft"] = ft_not_run(run, lr, "--no-retrieval-ft")
                else:
                    write_record(run, runs_dir, rec)  # the run's scores are safe before the fine-tune starts
                    rec["retrieval_ft"] = retrieval_fine_tune(run, lr, rec, data=data, work=work, device=device,
                                                              gpus=gpus, deadline=end, log=log, in_process=in_process)
    if run.tokenizer != "byte" and bpe_cache_ready(run, data):  # the cache it used: epochs, bytes per token
        try:
            tok = ensure_bpe(run, data)
            tok["epochs"] = run.tokens / tok["splits"]["train"]["tokens"]
            if run.tokens_per_batch != SMOKE["tokens_per_batch"]:  # the plan's budget assumed this tokenizer
                tok["as_planned"] = (tok["name"] == BPE_TOKENIZER
                                     and tok["splits"]["train"]["tokens"] == BPE_TRAIN_TOKENS)
            rec["tokenizer"] = tok
        except Exception as err:  # noqa: BLE001 - the run's scores stand; the record says why
            rec["tokenizer"] = {"spec": run.tokenizer, "error": f"{type(err).__name__}: {err}"}
    rec["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    write_record(run, runs_dir, rec)
    if rec["status"] == "done" and os.environ.get("QUALITY_KEEP_CHECKPOINTS") != "1":
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return rec


def curves(rows: list[dict]) -> dict:
    """The validation curve (every evaluation: bits per byte with the byte tokenizer, else ``None`` and the
    per-token loss and perplexity) and a thinned training-loss curve (<= 200 points)."""
    val = [{"step": r["step"], "tokens": r["tokens"], "time_s": r["time_s"], "bpb": r.get("val_bpb"),
            "loss": r.get("val_loss"), "perplexity": r.get("val_ppl")}
           for r in rows if r.get("val_bpb") is not None or r.get("val_ppl") is not None]
    train = [r for r in rows if r.get("loss") is not None]
    stride = max(1, len(train) // 200)
    tl = [{"step": r["step"], "tokens": r["tokens"], "time_s": r["time_s"], "loss": r["loss"]}
          for r in train[::stride]]
    times = [r["time_s"] for r in train]
    steps = [r["step"] for r in train]
    timing = {}
    if len(times) >= 3:
        dts = sorted(b - a for a, b in zip(times[1:], times[2:]))
        med = dts[len(dts) // 2]
        # the first step holds compilation / graph capture: its excess over a median step is "one-off"
        timing = {"median_step_s": med, "first_step_s": times[0] if steps[0] == 1 else None,
                  "one_off_s": max(0.0, times[0] - med * steps[0]), "train_s": times[-1],
                  "tokens_per_s": (train[-1]["tokens"] - train[0]["tokens"]) / max(times[-1] - times[0], 1e-9)}
    return {"val_curve": val, "train_curve": tl, "timing": timing}


def manifest_of(data: Path, run: Run) -> Path:
    return data / "corpus_manifest_smoke.json" if run.tokens_per_batch == SMOKE["tokens_per_batch"] else MANIFEST


def _tail(log: Path, n: int = 1500) -> str:
    try:
        return log.read_text()[-n:]
    except OSError:
        return ""


def _corpus_summary(manifest: Path) -> dict:
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return {}
    return {"content_sha256": m.get("content_sha256"), "smoke": m.get("smoke"), "documents": m.get("documents"),
            "tokens": {s: v["tokens"] for s, v in m["splits"].items()}}


# ------------------------------------------------------------------------------------------- scheduler


def select(runs: list[Run], only: str | None) -> list[Run]:
    if not only:
        return runs
    keys = [k.strip() for k in only.split(",") if k.strip()]

    def hit(r: Run) -> bool:
        return any(k in (r.id, r.kind, r.family, str(r.context)) for k in keys)

    return [r for r in runs if hit(r)]


def next_plan(smoke: bool, only: str | None, runs_dir: Path,
              taken: set[str]) -> tuple[list[Run], list[Run], list[Run]]:
    """``(the plan, the runs ``only`` selects, those left to start)`` as the records now stand (a finished sweep
    rung may have called for its family's next rung); ``taken``: ids not to start again in this call."""
    all_runs = plan(smoke=smoke, runs_dir=runs_dir)
    runs = select(all_runs, only)
    return all_runs, runs, [r for r in runs if r.id not in taken and not settled(r, runs_dir)]


def start_estimate(run: Run, device: str, retrieval: bool = True) -> float:
    """Seconds the scheduler needs left to start ``run``: training + start-up + scoring + the retrieval reserve where
    the run measures retrieval (a study run, without ``--no-retrieval``); the fine-tune is checked by the run itself.
    On a CPU (the smoke) a flat 10 s."""
    if device != "cuda":
        return 10.0
    return run.est_s + START_S + EVAL_S + (run.retrieval_s if retrieval else 0.0)


def gpu_ids() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    base = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in base.split(",") if s.strip()] if base else [str(i) for i in range(torch.cuda.device_count())]
    return ids[: torch.cuda.device_count()]


def ensure_data(data: Path, smoke: bool) -> None:
    """The token cache exists, or is made: unpacked from ``corpus.tar.xz`` (a GPU call) or built (--smoke)."""
    if (data / "cache" / "train.bin").exists() and (data / "corpus").is_dir():
        return
    import corpus as corpus_mod  # noqa: PLC0415 - beside this script

    if smoke:
        corpus_mod.main(["--smoke", "--data", str(data)])
    else:
        corpus_mod.main(["--unpack", "--data", str(data)])


def describe(runs: list[Run], runs_dir: Path, smoke: bool = False, call_s: float = 540.0) -> str:
    """The plan as a table: each run's tokens, GPUs, estimated training and device seconds, the retrieval fine-tune's
    estimated device seconds and whether the whole run with it fits one call of ``call_s`` seconds."""
    split = None if smoke else corpus_train_tokens()
    lines = [f"{'run':34s} {'kind':6s} {'ctx':>6s} {'tokenizer':>9s} {'tokens':>8s} {'epochs':>6s} {'gpus':>4s} "
             f"{'est train s':>11s} {'device s':>9s} {'+ rft s':>7s} {'rft fits':>8s}  status"]
    tot = 0.0
    left = 0.0
    ft_tot = 0.0
    for r in runs:
        rec = read_record(r, runs_dir)
        st = rec.get("status") if rec else "not run"
        if rec and st == "done" and not r.no_retrieval_why:
            st += f", rft {(rec.get('retrieval_ft') or {}).get('status', 'not run')}"
        if r.kind == "sweep" and diverged(rec):
            st += ", diverged: worse than any finished rung"
        if r.kind == "sweep" and r.lr_factor not in ladder_rule(smoke)[0]:
            st += " (ladder extension)"
        tot += r.est_device_s
        ft_tot += r.est_ft_device_s
        left += 0 if settled(r, runs_dir) else r.est_device_s + r.est_ft_device_s
        epochs = r.tokens / (BPE_TRAIN_TOKENS if r.tokenizer != "byte" else split) if split else None
        whole = r.est_s + START_S + EVAL_S + r.retrieval_s + r.retrieval_ft_s
        fits = "-" if r.no_retrieval_why else ("yes" if whole <= call_s else f"no {whole:.0f}")
        lines.append(f"{r.id:34s} {r.kind:6s} {r.context:6d} {r.tokenizer:>9s} {r.tokens / 1e6:7.1f}M "
                     f"{'-' if epochs is None else format(epochs, '.2f'):>6s} {r.gpus:4d} {r.est_s:11.0f} "
                     f"{r.est_device_s:9.0f} {r.est_ft_device_s:7.0f} {fits:>8s}  {st}")
    prep = BPE_PREPARE_S if any(r.tokenizer != "byte" for r in runs) else 0.0
    prep_left = prep if any(r.tokenizer != "byte" and not is_done(r, runs_dir) for r in runs) else 0.0
    lines.append(f"{len(runs)} runs; estimated device time {(tot + prep) / 3600:.1f} GPU-hours in all, "
                 f"{(tot + ft_tot + prep) / 3600:.1f} with the retrieval fine-tunes, "
                 f"{(left + prep_left) / 3600:.1f} left (training at the planned throughputs + {START_S:.0f} s start + "
                 f"{EVAL_S:.0f} s scoring + {RETRIEVAL_S:.0f} s retrieval per study run: none for the sweep and "
                 f"bpe runs"
                 + (f"; + {prep:.0f} s once per call with a bpe run: its tokenizer and cache" if prep else "") + ")")
    steps = SMOKE["retrieval_ft_steps"] if smoke else RETRIEVAL_FT_STEPS
    lines.append(f"retrieval fine-tune ('+ rft s'): {steps} steps of the run's batch at its context, "
                 f"{RETRIEVAL_FT_MIX:.0%} synthetic passkey / needle documents, {RETRIEVAL_FT_LR_FACTOR:g} x the peak "
                 f"rate; {RETRIEVAL_FT_PREP_S:.0f} s documents + {START_S:.0f} s start + training + "
                 f"{RETRIEVAL_S:.0f} s retrieval; 'rft fits': the run with it within one {call_s:.0f}-s call "
                 f"(else the run skips it, recorded 'not run' with the reason)")
    start, (lo, hi) = ladder_rule(smoke)
    for fam in dict.fromkeys(r.family for r in runs if r.kind == "sweep"):
        lines.append(f"learning-rate ladder ({fam}): {sweep_ladder(fam, runs, runs_dir).why}")
    if any(r.kind == "sweep" for r in runs):
        lines.append(f"(the ladder starts at x {' / '.join(f'{f:g}' for f in start)}; a best at its top / bottom edge "
                     f"adds the next rung out, x{LR_LADDER_STEP:g} / x1/{LR_LADDER_STEP:g} of that edge, within "
                     f"x{lo:g}-x{hi:g}; the family's study runs wait until the best is interior or at the cap)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting runs that cannot end by then")
    ap.add_argument("--only", default=None, help="comma list: run ids, 'sweep' / 'study' / 'bpe', families, contexts")
    ap.add_argument("--list", action="store_true", help="print the plan with its status and estimates, run nothing")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny presets on the smoke corpus, a few steps per run, records under data/smoke_runs")
    ap.add_argument("--max-runs", type=int, default=None, help="start at most this many runs")
    ap.add_argument("--data", type=Path, default=None, help="corpus folder (default data/, --smoke: data/smoke/)")
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=WORK)
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    ap.add_argument("--no-retrieval", action="store_true",
                    help="skip passkey / needle after a run's scoring, and the retrieval fine-tune (the record says "
                         "'not run')")
    ap.add_argument("--no-retrieval-ft", action="store_true",
                    help="measure retrieval as trained only: skip the retrieval fine-tune and its second measurement")
    args = ap.parse_args(argv)
    runs_dir = args.runs_dir or (DATA / "smoke_runs" if args.smoke else RUNS)
    args.data = args.data or (DATA / "smoke" if args.smoke else DATA)
    if args.smoke and args.work == WORK:
        args.work = DATA / "smoke_work"
    taken: set[str] = set()  # started in this call (never twice), or planned on more GPUs than this machine has
    all_runs, runs, pending = next_plan(args.smoke, args.only, runs_dir, taken)
    if args.list:
        print(describe(runs, runs_dir, smoke=args.smoke, call_s=args.budget_s))
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    ensure_data(args.data, args.smoke)
    gpus = gpu_ids() if args.device in (None, "cuda") else []
    device = "cuda" if gpus else "cpu"
    slots = gpus or ["cpu"]
    free = list(slots)
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    print(f"run: {len(slots)} slot(s) ({device}); budget {args.budget_s:.0f} s; "
          f"{len(pending)} of {len(runs)} selected runs left", flush=True)
    running: dict[int, tuple[subprocess.Popen, Run, list[str]]] = {}
    started = 0
    skipped: dict[str, str] = {}
    while True:
        for pid, (proc, r, held) in list(running.items()):
            if proc.poll() is not None:
                rec = read_record(r, runs_dir) or {}
                print(f"[{time.monotonic() - t_start:5.0f} s] {r.id}: {rec.get('status', 'no record')}"
                      + (f", val {rec['final']['validation_bpb']:.4f} test {rec['final']['test_bpb']:.4f} bits/byte"
                         if rec.get("status") == "done" else ""), flush=True)
                free.extend(held)
                del running[pid]
                all_runs, runs, pending = next_plan(args.smoke, args.only, runs_dir, taken)
        left = deadline - time.monotonic()
        launched = False
        for r in list(pending):
            if args.max_runs is not None and started >= args.max_runs:
                break
            need = 1 if device == "cpu" else r.gpus
            if need > len(slots):
                skipped[r.id] = f"planned on {r.gpus} GPUs, this machine has {len(slots)}"
                pending.remove(r)
                taken.add(r.id)
                continue
            est = start_estimate(r, device, retrieval=not args.no_retrieval)
            if est > left:
                skipped[r.id] = f"needs ~{est:.0f} s, {left:.0f} s left"
                continue
            ft_note = ""  # the run starts without the fine-tune's time; the run itself skips it when it cannot fit
            if device == "cuda" and not (args.no_retrieval or args.no_retrieval_ft) and r.retrieval_ft_s \
                    and est + r.retrieval_ft_s > left:
                ft_note = f"; the retrieval fine-tune (~{r.retrieval_ft_s:.0f} s more) will not fit"
            if need > len(free):
                continue
            if r.kind in ("study", "bpe"):
                lr, why = swept_lr(r.family, all_runs, runs_dir)
                if lr is None:  # stays pending: a sweep run still going may unblock it in this call
                    skipped[r.id] = why
                    continue
            else:
                lr, why = r.lr, f"sweep: recipe rate x {r.lr_factor:g}"
            if r.tokenizer != "byte" and not bpe_cache_ready(r, args.data):
                prep = BPE_PREPARE_S if device == "cuda" else 0.0
                if est + prep > left:
                    skipped[r.id] = f"needs ~{est + prep:.0f} s with the BPE's preparation, {left:.0f} s left"
                    continue
                print(f"[{time.monotonic() - t_start:5.0f} s] preparing {r.tokenizer} (tokenizer + token cache) "
                      f"in {cache_dir(r, args.data)}", flush=True)
                tok = ensure_bpe(r, args.data)
                print(f"[{time.monotonic() - t_start:5.0f} s] {tok['name']}: "
                      + ", ".join(f"{s} {v['tokens']:,} tokens" for s, v in tok["splits"].items()), flush=True)
                launched = True
                break  # re-scan with the time now left
            held = [free.pop(0) for _ in range(need)]
            if device == "cpu":  # one slot: run it here (no second interpreter to start)
                print(f"[{time.monotonic() - t_start:5.0f} s] start {r.id} on cpu (lr {lr:.3g})", flush=True)
                rec = run_one(r, lr, why, data=args.data, work=args.work, runs_dir=runs_dir, device="cpu",
                              time_budget_s=left - 5, gpus=1, log=args.work / "logs" / f"{r.id}.log", in_process=True,
                              retrieval=not args.no_retrieval, retrieval_ft=not args.no_retrieval_ft)
                print(f"[{time.monotonic() - t_start:5.0f} s] {r.id}: {rec['status']}"
                      + (f", val {rec['final']['validation_bpb']:.4f} test {rec['final']['test_bpb']:.4f} bits/byte"
                         if rec["status"] == "done" else ""), flush=True)
                free.extend(held)
                taken.add(r.id)
                skipped.pop(r.id, None)
                started += 1
                launched = True
                all_runs, runs, pending = next_plan(args.smoke, args.only, runs_dir, taken)
                break  # re-scan: a finished sweep may unblock study runs, or call for the next rung
            cmd = [sys.executable, str(Path(__file__).resolve()), "_one", "--id", r.id, "--lr", repr(lr),
                   "--lr-source", why, "--time-s", f"{left - 5:.0f}", "--data", str(args.data),
                   "--runs-dir", str(runs_dir), "--work", str(args.work), "--device", device,
                   "--gpus", str(need)] + (["--smoke"] if args.smoke else []) + (
                   ["--no-retrieval"] if args.no_retrieval else []) + (
                   ["--no-retrieval-ft"] if args.no_retrieval_ft else [])
            env = dict(os.environ)
            if device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(held)
            proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            running[proc.pid] = (proc, r, held)
            pending.remove(r)
            taken.add(r.id)
            skipped.pop(r.id, None)
            started += 1
            launched = True
            print(f"[{time.monotonic() - t_start:5.0f} s] start {r.id} on {','.join(held)} (lr {lr:.3g}; est {est:.0f} s"
                  f"{ft_note})", flush=True)
        if not running and not launched:
            break
        if time.monotonic() > deadline + 30:  # a run past its own --time: stop it, keep what it wrote
            for proc, r, _ in running.values():
                os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.5 if args.smoke else 2.0)
    for rid, why in skipped.items():
        print(f"not started: {rid}: {why}")
    done = sum(is_done(r, runs_dir) for r in runs)
    print(f"run: {done} of {len(runs)} selected runs done; records in {runs_dir}; "
          f"{time.monotonic() - t_start:.0f} s", flush=True)
    return 0


def main_one(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--id", required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--lr-source", default="")
    ap.add_argument("--time-s", type=float, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--runs-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-retrieval", action="store_true")
    ap.add_argument("--no-retrieval-ft", action="store_true")
    a = ap.parse_args(argv)
    run = {r.id: r for r in plan(smoke=a.smoke, runs_dir=a.runs_dir)}[a.id]
    run_one(run, a.lr, a.lr_source, data=a.data, work=a.work, runs_dir=a.runs_dir, device=a.device,
            time_budget_s=a.time_s, gpus=a.gpus, log=a.work / "logs" / f"{run.id}.log", retrieval=not a.no_retrieval,
            retrieval_ft=not a.no_retrieval_ft)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        sys.exit(main_one(sys.argv[2:]))
    sys.exit(main())
