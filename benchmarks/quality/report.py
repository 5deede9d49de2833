#!/usr/bin/env python3
"""The study's tables and plots (issue 43) from the run records of ``run.py``.

Reads ``benchmarks/quality/runs/*.json`` against the plan (``run.plan(runs_dir=...)``: with the rungs the
learning-rate sweep's adaptive ladder has called for) and rewrites the block
between ``<!-- BEGIN quality-study -->`` and ``<!-- END quality-study -->`` in ``docs/results.md``
(plots: ``docs/results/quality_*.png`` when matplotlib is there, else a line says they were skipped).

What each table computes (every cell states seeds, tokens, context, training time and commit; a
planned cell with no finished run says ``not run``):

* **learning-rate sweep**: each family's rungs (a column per factor on any family's ladder; ``-`` where a
  factor is not on that family's) and the chosen rate with its factor and whether it is interior to the
  ladder or at its cap, or what the family's study runs wait for (``run.sweep_ladder``);
* **final scores**: validation and test bits per byte (``lintime.evaluation.evaluate``, first 2^22
  tokens of each split, whole documents, at the training context), mean ± sample standard deviation
  over the finished seeds;
* **training time**: the trainer's training wall time (validation excluded) minus the one-off excess
  of its first step (compilation, graph capture), times the GPUs the run used (GPU-seconds);
* **speed-up at matched quality** (the FLASH seed's Table 3): the target is Transformer++'s mean
  *last validation-curve point* at that context (the curve's own evaluation, so a run is compared
  with itself on the same tokens); for each seed of a family the GPU-seconds at which its validation
  curve first reaches the target (linear interpolation between evaluations); the speed-up is
  Transformer++'s mean training time over that time, mean ± spread over the seeds that reach it
  (``not reached (k/n)`` otherwise);
* **quality at equal wall time**: each family's validation bits per byte at 0.25, 0.5 and 1 x
  Transformer++'s mean training time (interpolated on its curve; a run that ended earlier counts
  with its last value, marked ‡);
* **retrieval** (its own block, ``<!-- BEGIN quality-retrieval -->``): passkey and the multi-key
  needle (``retrieval.py``) at 1x / 2x / 4x each run's trained context, accuracy per family x
  context (mean over seeds, ``not run`` where missing), two rows per family: as trained and after
  ``run.py``'s retrieval fine-tune (the record's ``retrieval_ft``); a context is readable only when
  Transformer++'s passkey at 1x **after the fine-tune** reaches 90 % in every seed (issue 43's
  bar, judged on the fine-tuned rows; the as-trained verdict is stated beside it), and the table
  says "not readable" otherwise;
* **BPE** (its own block, ``<!-- BEGIN quality-bpe -->``): the ``bpe`` runs (every family at one
  context, lintime's 32k BPE): validation and test per-token perplexity (``exp`` of the mean loss per
  scored token, ``<eos>`` included), their gap to Transformer++'s, bits per byte on the same documents
  as the byte runs' final scores beside the family's byte-level run at that context, bytes per token;
* **claims** are made only where the spread allows: two means differ when
  ``|a - b| > s_a + s_b`` (one seed: no claim).

Usage::

    python3 benchmarks/quality/report.py                      # rewrite docs/results.md's block + plots
    python3 benchmarks/quality/report.py --print              # the block on stdout only
    python3 benchmarks/quality/report.py --smoke --print      # the --smoke records

The page's three blocks: ``quality-study``, ``quality-retrieval``, ``quality-bpe``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import retrieval  # noqa: E402
import run as study  # noqa: E402

RESULTS_MD = REPO / "docs" / "results.md"
PLOTS = REPO / "docs" / "results"
BEGIN, END = "<!-- BEGIN quality-study -->", "<!-- END quality-study -->"
REFERENCE = "transformer-pp"
NAMES = {"flash": "FLASH", "transformer-pp": "Transformer++", "gla": "GLA", "vq": "Transformer-VQ"}
EQUAL_TIME_FRACTIONS = (0.25, 0.5, 1.0)
RBEGIN, REND = "<!-- BEGIN quality-retrieval -->", "<!-- END quality-retrieval -->"
READABLE_BAR = 0.90  # issue 43: the softmax anchor retrieves the passkey at >= 90 % inside its trained context
BBEGIN, BEND = "<!-- BEGIN quality-bpe -->", "<!-- END quality-bpe -->"


# ------------------------------------------------------------------------------------------- numbers


def mean_sd(xs: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for one value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) if len(xs) > 1 else None)


def fmt(xs: list[float], digits: int = 4, unit: str = "") -> str:
    if not xs:
        return "-"
    m, s = mean_sd(xs)
    return f"{m:.{digits}f}{unit}" + (f" ± {s:.{digits}f}" if s is not None else "") + f" ({_seeds(len(xs))})"


def _seeds(n: int) -> str:
    return "1 seed" if n == 1 else f"{n} seeds"


def differs(a: list[float], b: list[float]) -> bool | None:
    """``|mean_a - mean_b| > sd_a + sd_b``; ``None`` (no claim) when a side has fewer than two values."""
    if len(a) < 2 or len(b) < 2:
        return None
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    return abs(ma - mb) > sa + sb


def one_off(rec: dict) -> float:
    return float((rec.get("timing") or {}).get("one_off_s") or 0.0)


def gpu_seconds(rec: dict, t: float) -> float:
    """A curve time (trainer seconds) as GPU-seconds with the one-off excess removed."""
    return max(t - one_off(rec), 0.0) * int(rec.get("gpus") or 1)


def train_time(rec: dict) -> float:
    curve = rec.get("val_curve") or []
    t = (rec.get("timing") or {}).get("train_s")
    if t is None and curve:
        t = curve[-1]["time_s"]
    return gpu_seconds(rec, float(t or 0.0))


def curve_points(rec: dict) -> list[tuple[float, float]]:
    """``[(GPU-seconds, validation bits per byte)]`` of a run's curve."""
    return [(gpu_seconds(rec, p["time_s"]), p["bpb"]) for p in rec.get("val_curve") or []]


def time_to_reach(points: list[tuple[float, float]], target: float) -> float | None:
    """First time the curve is at or below ``target`` (linear between points); ``None`` if never."""
    prev = None
    for t, v in points:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            t0, v0 = prev
            return t0 + (v0 - target) / (v0 - v) * (t - t0)
        prev = (t, v)
    return None


def value_at(points: list[tuple[float, float]], t: float) -> tuple[float | None, bool]:
    """The curve's value at time ``t`` (linear); ``(last value, True)`` when the run ended before ``t``;
    ``(None, False)`` before its first point."""
    if not points or t < points[0][0]:
        return None, False
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return (v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)), False
    return points[-1][1], t > points[-1][0]


# ------------------------------------------------------------------------------------------- tables


def load(runs_dir: Path, plan: list) -> dict[str, dict]:
    out = {}
    for r in plan:
        p = runs_dir / f"{r.id}.json"
        if p.exists():
            try:
                out[r.id] = json.loads(p.read_text())
            except ValueError:
                pass
    return out


def done(records: dict, runs: list) -> list[dict]:
    return [records[r.id] for r in runs if records.get(r.id, {}).get("status") == "done"]


def cell_info(recs: list[dict]) -> str:
    """Tokens, training time and commit(s) of a cell's finished runs."""
    if not recs:
        return ""
    toks = sorted({(rec.get("tokens") or rec["run"]["tokens"]) for rec in recs})
    commits = sorted({(rec.get("commit") or "?")[:7] for rec in recs})
    gpus = sorted({int(rec.get("gpus") or 1) for rec in recs})
    tt = [train_time(rec) for rec in recs]
    return (f"{'/'.join(f'{t / 1e6:.1f}M' for t in toks)} tokens, {statistics.fmean(tt):.0f} GPU-s"
            + (f" on {gpus[0]} GPUs (DDP)" if gpus != [1] else "") + f", commit {'/'.join(commits)}")


def study_tables(records: dict, plan: list) -> dict:
    """Every number the page shows, as data: ``{context: {family: {...}}}`` plus the sweep (each family's rungs as
    its adaptive ladder has them, ``run.sweep_ladder``, and the ladder's verdict)."""
    contexts = sorted({r.context for r in plan if r.kind == "study"})
    families = list(dict.fromkeys(r.family for r in plan))
    start, (lo, hi) = study.ladder_rule(bool(plan) and plan[0].smoke)
    out: dict = {"contexts": {}, "sweep": {}, "ladder": {},
                 "ladder_rule": {"start": start, "range": (lo, hi), "step": study.LR_LADDER_STEP}}
    for fam in families:
        lad = study.sweep_ladder(fam, plan, records)
        out["sweep"][fam] = []
        for r in lad.rungs:
            rec = records.get(r.id) or {}
            bpb = (rec.get("final") or {}).get("validation_bpb") if rec.get("status") == "done" else None
            out["sweep"][fam].append({
                "id": r.id, "lr": r.lr, "factor": r.lr_factor, "context": r.context,
                "status": rec.get("status", "not run"), "diverged": study.diverged(rec),
                "validation_bpb": bpb if isinstance(bpb, (int, float)) and math.isfinite(bpb) else None})
        out["ladder"][fam] = {
            "state": lad.state, "why": lad.why, "lr": lad.best.lr if lad.best else None,
            "factor": lad.best.lr_factor if lad.best else None, "rungs": len(lad.rungs),
            "waiting": [(r.lr_factor, (records.get(r.id) or {}).get("status", "not run")) for r in lad.waiting]}
    for ctx in contexts:
        row: dict = {}
        planned = {fam: [r for r in plan if r.kind == "study" and r.family == fam and r.context == ctx]
                   for fam in families}
        for fam, runs in planned.items():
            recs = done(records, runs)
            row[fam] = {
                "planned": len(runs), "done": len(recs),
                "val": [rec["final"]["validation_bpb"] for rec in recs],
                "test": [rec["final"]["test_bpb"] for rec in recs],
                "last_curve": [rec["val_curve"][-1]["bpb"] for rec in recs if rec.get("val_curve")],
                "time": [train_time(rec) for rec in recs],
                "lr": sorted({rec.get("lr") for rec in recs}),
                "info": cell_info(recs),
                "records": recs,
            }
        ref = row.get(REFERENCE)
        if ref and ref["done"]:
            target = statistics.fmean(ref["last_curve"])
            ref_time = statistics.fmean(ref["time"])
            for fam, cell in row.items():
                reach = [time_to_reach(curve_points(rec), target) for rec in cell["records"]]
                got = [t for t in reach if t is not None and t > 0]
                cell["target"] = target
                cell["ref_time"] = ref_time
                cell["speedup"] = [ref_time / t for t in got]
                cell["reached"] = (len(got), len(reach))
                cell["equal_time"] = {}
                for f in EQUAL_TIME_FRACTIONS:
                    vals = [value_at(curve_points(rec), f * ref_time) for rec in cell["records"]]
                    cell["equal_time"][f] = ([v for v, _ in vals if v is not None], any(e for _, e in vals))
        out["contexts"][ctx] = row
    return out


def sweep_cell(s: dict | None) -> str:
    """A sweep table cell: the rung's final validation bits per byte and rate, why it has none, or ``-`` (the factor
    is not on this family's ladder)."""
    if s is None:
        return "-"
    if s["validation_bpb"] is not None:
        return f"{s['validation_bpb']:.4f} (lr {s['lr']:.2g})"
    if s["diverged"]:
        return "diverged" if s["status"] == "failed" else "no finite score"
    return s["status"]


def chosen_text(lad: dict) -> str:
    """The sweep table's 'chosen' cell: the rate with its factor and whether it is interior or at the cap, or what
    the family's study waits for."""
    if lad["state"] in ("interior", "at the cap"):
        return f"{lad['lr']:.2g} (x{lad['factor']:g}, {lad['state']})"
    if lad["state"] == "waits":
        return "- (waits: " + ", ".join(f"x{f:g} {st}" for f, st in lad["waiting"]) + ")"
    return "- (no finite score)" if lad["rungs"] else "-"


def sweep_markdown(tables: dict) -> list[str]:
    sweep, rule = tables["sweep"], tables["ladder_rule"]
    (lo, hi), step = rule["range"], rule["step"]
    ctx = sorted({s["context"] for rows in sweep.values() for s in rows})
    L = ["### Learning-rate sweep\n",
         f"Context {'/'.join(map(str, ctx)) or '-'}, seed 0, an adaptive ladder on the seed recipe's peak rate: first "
         f"x {' / '.join(f'{f:g}' for f in rule['start'])}; while a family's best run (lowest final validation bits "
         f"per byte) is at the top or bottom edge of its ladder, the next rung out (x {step:g} or x 1/{step:g} that "
         f"edge's factor) is run, within x {lo:g} to x {hi:g} (the cap). A rung that diverged or ended without a "
         f"finite score counts as worse than any finished one, so it also ends the ladder on its side. A family's "
         f"study runs use its best rate and wait until that is interior to the ladder or at the cap ('chosen' says "
         f"which, or what they wait for); `-`: not on that family's ladder. Sweep runs skip retrieval by the plan "
         f"(it is measured on the study runs). A rung with a record shows even while a first rung still waits.\n"]
    factors = sorted({s["factor"] for rows in sweep.values() for s in rows})
    L.append("| family | " + " | ".join(f"x {f:g}" for f in factors) + " | chosen |")
    L.append("|---|" + "---|" * (len(factors) + 1))
    for fam, rows in sweep.items():
        cells = [sweep_cell(next((x for x in rows if x["factor"] == f), None)) for f in factors]
        L.append(f"| {NAMES.get(fam, fam)} | " + " | ".join(cells) + f" | {chosen_text(tables['ladder'][fam])} |")
    return L + [""]


def markdown(tables: dict, plots: list[str], note: str = "") -> str:
    L: list[str] = sweep_markdown(tables)
    for ctx, row in tables["contexts"].items():
        L.append(f"### Context {ctx}\n")
        L.append("| family | seeds | validation bits/byte | test bits/byte | lr | tokens, training time, commit |")
        L.append("|---|---|---|---|---|---|")
        for fam, c in row.items():
            if not c["done"]:
                L.append(f"| {NAMES.get(fam, fam)} | 0/{c['planned']} | not run | not run | - | - |")
                continue
            L.append(f"| {NAMES.get(fam, fam)} | {c['done']}/{c['planned']} | {fmt(c['val'])} | {fmt(c['test'])} | "
                     f"{', '.join(f'{x:.2g}' for x in c['lr'])} | {c['info']} |")
        ref = row.get(REFERENCE)
        L.append("")
        if not ref or not ref["done"]:
            L.append(f"Speed-up and equal-time tables: not run (no finished {NAMES[REFERENCE]} run at {ctx}).\n")
            continue
        target, ref_time = ref["target"], ref["ref_time"]
        L.append(f"Speed-up at matched quality: GPU-seconds for each family's validation curve to reach "
                 f"{NAMES[REFERENCE]}'s mean final curve value {target:.4f} bits/byte, over {NAMES[REFERENCE]}'s "
                 f"mean training time {ref_time:.0f} GPU-s. Quality at equal wall time: validation bits/byte at "
                 + ", ".join(f"{f:g} x" for f in EQUAL_TIME_FRACTIONS) + " that time (‡: a seed had ended earlier).\n")
        L.append("| family | speed-up | " + " | ".join(f"at {f:g} x ({f * ref_time:.0f} GPU-s)"
                                                        for f in EQUAL_TIME_FRACTIONS) + " | differs from Transformer++ (val) |")
        L.append("|---|---|" + "---|" * len(EQUAL_TIME_FRACTIONS) + "---|")
        for fam, c in row.items():
            if not c["done"]:
                L.append(f"| {NAMES.get(fam, fam)} | not run |" + " not run |" * len(EQUAL_TIME_FRACTIONS) + " - |")
                continue
            k, n = c["reached"]
            sp = (fmt(c["speedup"], 2, "x") + ("" if k == n else f", {k}/{n} reached")) if k else f"not reached (0/{n})"
            if fam == REFERENCE:
                sp = "(reference)"
            eq = []
            for f in EQUAL_TIME_FRACTIONS:
                vals, ended = c["equal_time"][f]
                eq.append((fmt(vals) + (" ‡" if ended else "")) if vals else "-")
            d = differs(c["val"], ref["val"]) if fam != REFERENCE else None
            dtxt = "-" if fam == REFERENCE else ("no claim (fewer than 2 seeds)" if d is None else
                                               ("yes" if d else "no (within the spread)"))
            L.append(f"| {NAMES.get(fam, fam)} | {sp} | " + " | ".join(eq) + f" | {dtxt} |")
        L.append("")
    for p in plots:
        L.append(f"![{Path(p).name}]({p})")
    if note:
        L.append(note)
    return "\n".join(L).rstrip() + "\n"


def make_plots(tables: dict, out_dir: Path, rel: str) -> tuple[list[str], str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "(plots skipped: matplotlib is not installed)"
    paths = []
    for ctx, row in tables["contexts"].items():
        if not any(c["done"] for c in row.values()):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for i, (fam, c) in enumerate(row.items()):
            for j, rec in enumerate(c["records"]):
                pts = curve_points(rec)
                toks = [p["tokens"] / 1e6 for p in rec.get("val_curve") or []]
                lab = NAMES.get(fam, fam) if j == 0 else None
                axes[0].plot([t for t, _ in pts], [v for _, v in pts], color=f"C{i}", label=lab, alpha=0.8)
                axes[1].plot(toks, [v for _, v in pts], color=f"C{i}", label=lab, alpha=0.8)
        axes[0].set_xlabel("training GPU-seconds (one-off compile excluded)")
        axes[1].set_xlabel("training tokens (M)")
        for ax in axes:
            ax.set_ylabel("validation bits/byte")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"context {ctx}")
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        p = out_dir / f"quality_bpb_{ctx}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(f"{rel}/{p.name}")
    return paths, ""


# ------------------------------------------------------------------------------------------- retrieval


STAGES = ("as trained", "fine-tuned")  # a run's "retrieval" and its retrieval fine-tune's ("retrieval_ft")
JUDGED = "fine-tuned"  # the stage the bar is judged on


def stage_retrieval(rec: dict, stage: str) -> dict | None:
    """A record's retrieval entry of ``stage``: as trained (``retrieval``) or after the retrieval fine-tune
    (``retrieval_ft.retrieval``; a fine-tune that did not finish gives its not-run cells with the reason)."""
    if stage == "as trained":
        return rec.get("retrieval")
    ft = rec.get("retrieval_ft")
    if not ft:
        return None
    if ft.get("status") != "done":
        why = f"fine-tune {ft.get('status', 'not run')}: {ft.get('why', '')}".rstrip(": ")
        return {"cells": [dict(c, status="not run", why=why) for c in (ft.get("retrieval") or {}).get("cells", [])]}
    return ft.get("retrieval")


def retrieval_table(records: dict, plan: list) -> dict:
    """``{"rows": {context: {family: {stage: {(task, multiple): cell}}}}, "readable": {context: (bool, why)},
    "as_trained_pass": {context: (bool, why)}}`` for the stages :data:`STAGES`.

    A cell: ``{"acc": [accuracy per finished seed], "n": seeds with the run done, "why": ...}``;
    accuracies are each seed's mean over its depths (``retrieval.accuracy``).  A context is
    readable when Transformer++'s passkey at 1x **after the retrieval fine-tune** (:data:`JUDGED`)
    reaches :data:`READABLE_BAR` in every seed measured (at least one); the table is readable when
    every context is.  ``as_trained_pass`` says the same of the models as trained (shown, not the bar)."""
    contexts = sorted({r.context for r in plan if r.kind == "study"})
    families = list(dict.fromkeys(r.family for r in plan))
    rows: dict = {}
    readable: dict = {}
    as_trained: dict = {}
    for ctx in contexts:
        row: dict = {}
        for fam in families:
            recs = done(records, [r for r in plan if r.kind == "study" and r.family == fam and r.context == ctx])
            row[fam] = {}
            for stage in STAGES:
                cells = {}
                for task in retrieval.TASKS:
                    for m in retrieval.MULTIPLES:
                        ents = [stage_retrieval(rec, stage) for rec in recs]
                        accs = [a for a in (retrieval.accuracy(e, task, m) for e in ents) if a is not None]
                        whys = sorted({(retrieval.cell(e, task, m) or {}).get("why") or "not measured"
                                       for e in ents if retrieval.accuracy(e, task, m) is None})
                        cells[(task, m)] = {"acc": accs, "n": len(recs), "why": "; ".join(whys)}
                row[fam][stage] = cells
        rows[ctx] = row
        for stage, out in ((JUDGED, readable), ("as trained", as_trained)):
            anchor = row.get(REFERENCE, {}).get(stage, {}).get(("passkey", 1))
            name = f"{NAMES[REFERENCE]}'s passkey at 1x ({stage})"
            if not anchor or not anchor["acc"]:
                out[ctx] = (False, f"{name}: not run")
            elif len(anchor["acc"]) < anchor["n"]:
                out[ctx] = (False, f"{name}: {len(anchor['acc'])} of {anchor['n']} seeds measured")
            elif min(anchor["acc"]) < READABLE_BAR:
                out[ctx] = (False, f"{name}: {_pct(anchor['acc'])} < {READABLE_BAR:.0%}")
            else:
                out[ctx] = (True, f"{name}: {_pct(anchor['acc'])}")
    return {"rows": rows, "readable": readable, "as_trained_pass": as_trained,
            "all_readable": bool(readable) and all(v[0] for v in readable.values())}


def _pct(accs: list[float]) -> str:
    mean, low = f"{statistics.fmean(accs):.0%}", f"{min(accs):.0%}"
    return mean if low == mean else f"{mean} (min {low})"


def retrieval_cell_text(c: dict) -> str:
    if not c["acc"]:
        return "not run"
    k = len(c["acc"])
    return _pct(c["acc"]) + (f" ({k} seeds)" if k > 1 else "") + (f" ({k}/{c['n']})" if k < c["n"] else "")


def retrieval_markdown(tab: dict) -> str:
    ft = (f"{study.RETRIEVAL_FT_STEPS} steps of the run's batch (2^{study.TOKENS_PER_BATCH.bit_length() - 1} tokens: "
          f"{study.RETRIEVAL_FT_STEPS * study.TOKENS_PER_BATCH / 1e6:.1f}M tokens) at the run's context, "
          f"{study.RETRIEVAL_FT_LR_FACTOR:g} x its peak rate ({study.RETRIEVAL_FT_WARMUP:.1%} warm-up, cosine to 0, a "
          f"fresh optimiser), on a mixture of the corpus's train split and {study.RETRIEVAL_FT_MIX:.0%} synthetic "
          "passkey / needle documents in the evaluation's formats (train-split filler; keys, values and names never the "
          "evaluation's)")
    L = ["### Retrieval: passkey and multi-key needle (issue 43 item 3)\n",
         "Each finished study run's final model, right after its scoring (`run.py`, `retrieval.py`): lintime's passkey "
         "(one 5-digit key) and a multi-key needle (4 key/value pairs, one asked) in filler from the study corpus's test "
         "split, greedy decoding, 10 seeded trials at each of 5 depths (50 a length), at the trained context (1x) and "
         "at 2x and 4x it (extrapolation). A cell: accuracy over the 50 prompts (mean over seeds where several; "
         "`not run`: not measured, e.g. it did not fit the run's time budget).\n",
         f"Two rows per family: **as trained** (the run's final model) and **fine-tuned** (the same model after the "
         f"retrieval fine-tune, the same for every family: {ft}; `lintime train --init-from`, then measured again).\n",
         f"**The bar (issue 43):** the table is readable only where {NAMES[REFERENCE]} retrieves the passkey at "
         f">= {READABLE_BAR:.0%} inside its trained context (1x) in every seed; **judged on the fine-tuned rows** "
         f"(the as-trained models are not asked to pass it); below it, no family's number says anything.\n"]
    verdict = "readable" if tab["all_readable"] else "not readable"
    bad = [f"{ctx}: {why}" for ctx, (ok, why) in tab["readable"].items() if not ok]
    L.append(f"**Table: {verdict}** (the bar on the fine-tuned models)" + (f" ({'; '.join(bad)})" if bad else "") + "\n")
    passed = [str(ctx) for ctx, (ok, _) in tab.get("as_trained_pass", {}).items() if ok]
    L.append(f"As trained, {NAMES[REFERENCE]} passes the bar at: {', '.join(passed) if passed else 'no context'}.\n")
    head = ["context", "family", "model"] + [f"{t} {m}x" for t in retrieval.TASKS for m in retrieval.MULTIPLES] \
        + ["readable"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "---|" * len(head))
    for ctx, row in tab["rows"].items():
        ok = "yes" if tab["readable"][ctx][0] else "not readable"
        for fam, stages in row.items():
            for stage in STAGES:
                cells = stages[stage]
                L.append(f"| {ctx} | {NAMES.get(fam, fam)} | {stage} | "
                         + " | ".join(retrieval_cell_text(cells[(t, m)]) for t in retrieval.TASKS
                                      for m in retrieval.MULTIPLES)
                         + f" | {ok if stage == JUDGED else '-'} |")
    return "\n".join(L).rstrip() + "\n"


# ------------------------------------------------------------------------------------------- BPE


def bytes_per_token(final: dict, split: str) -> float | None:
    """UTF-8 bytes per scored token (``<eos>`` counted) of a run's final ``split`` scores."""
    n, b = final.get(f"{split}_targets"), final.get(f"{split}_bytes")
    return b / n if n and b else None


def ppl_gap(ppl: list[float], ref: list[float]) -> float | None:
    """Relative per-token perplexity change of a family's mean over the reference's mean (0.01 = +1 %)."""
    if not ppl or not ref:
        return None
    return statistics.fmean(ppl) / statistics.fmean(ref) - 1.0


def bpe_table(records: dict, plan: list) -> dict:
    """``{family: {...}}`` of the ``bpe`` runs (one context), with the family's byte-level study runs at that
    context beside them."""
    bpe = [r for r in plan if r.kind == "bpe"]
    byte_runs = [r for r in plan if r.kind == "study" and bpe and r.context == bpe[0].context]
    out: dict = {"context": bpe[0].context if bpe else None, "tokenizer": bpe[0].tokenizer if bpe else None,
                 "planned_tokens": bpe[0].tokens if bpe else None,
                 "byte_tokens": byte_runs[0].tokens if byte_runs else None, "families": {}}
    for fam in dict.fromkeys(r.family for r in bpe):
        runs = [r for r in bpe if r.family == fam]
        recs = done(records, runs)
        byte_recs = done(records, [r for r in plan if r.kind == "study" and r.family == fam and r.context == runs[0].context])
        fin = [rec["final"] for rec in recs]
        tok = [rec.get("tokenizer") or {} for rec in recs]
        same = [rb["final"].get("validation_bytes") == f.get("validation_bytes") for f in fin for rb in byte_recs
                if rb["final"].get("validation_bytes") is not None]
        out["families"][fam] = {
            "planned": len(runs), "done": len(recs),
            "val_ppl": [f["validation_perplexity"] for f in fin], "test_ppl": [f["test_perplexity"] for f in fin],
            "val": [f["validation_bpb"] for f in fin], "test": [f["test_bpb"] for f in fin],
            "bytes_per_token": [x for x in (bytes_per_token(f, "validation") for f in fin) if x is not None],
            "byte_val": [rb["final"]["validation_bpb"] for rb in byte_recs], "byte_planned": len(
                [r for r in plan if r.kind == "study" and r.family == fam and r.context == runs[0].context]),
            "same_documents": all(same) if same else None,
            "epochs": [x["epochs"] for x in tok if x.get("epochs")],
            "tokenizers": sorted({f.get("tokenizer") or "?" for f in fin}),
            "lr": sorted({rec.get("lr") for rec in recs}), "info": cell_info(recs),
        }
    ref = out["families"].get(REFERENCE)
    for fam, c in out["families"].items():
        c["gap"] = ppl_gap(c["val_ppl"], ref["val_ppl"]) if ref and fam != REFERENCE else None
    return out


def bpe_markdown(tab: dict) -> str:
    ctx, spec = tab["context"], tab["tokenizer"]
    if ctx is None:
        return "### BPE: per-token perplexity\n\nNo BPE run in the plan.\n"
    ids = spec.split(":", 1)[-1]
    budget = ""
    if spec == f"bpe:{study.BPE_VOCAB}":  # the full plan: its budget came from the measured train split
        budget = (f" ({tab['planned_tokens'] / study.BPE_TRAIN_TOKENS:.2f} epochs of the train split's "
                  f"{study.BPE_TRAIN_TOKENS / 1e6:.1f}M BPE tokens: the budget rule `max(100M tokens, 1 epoch)`, "
                  f"capped at 2 epochs)")
    byte = f", {_mtok(tab['byte_tokens'])} byte tokens" if tab["byte_tokens"] else ""
    L = [f"### BPE: per-token perplexity at context {ctx} (issue 43 item 1)\n",
         f"Each family at context {ctx}, seed 0, with lintime's byte-level BPE of {ids} ids trained on the study "
         f"corpus's train split (`lintime train --tokenizer {spec}`), {_mtok(tab['planned_tokens'])} tokens "
         f"each{budget}, the family's swept rate. Perplexity is per BPE token (`exp` of the mean loss per scored "
         f"token, `<eos>` included) on the same validation / test documents as the byte runs' final scores; bits per "
         f"byte is the summed loss over those documents' UTF-8 bytes, so it compares with the byte-level column (the "
         f"family's byte-level study runs at {ctx}{byte}). The seeds' perplexities are "
         f"on other corpora and tokenizers (FLASH: per token on Wiki-40B; Transformer-VQ: per word on PG-19 with a "
         f"32k SentencePiece BPE): what compares with their tables is the gap to {NAMES[REFERENCE]}, not the value."
         + (" One seed: no spread, so no claim beyond the numbers." if all(c["planned"] == 1 for c in
                                                                          tab["families"].values()) else "") + "\n"]
    L.append(f"| family | seeds | validation perplexity | test perplexity | vs {NAMES[REFERENCE]} (validation "
             "perplexity) | validation bits/byte | test bits/byte | byte-level run: validation bits/byte | "
             "bytes/token | lr | tokens (epochs), training time, commit, tokenizer |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for fam, c in tab["families"].items():
        name = NAMES.get(fam, fam)
        byte = (fmt(c["byte_val"]) if c["byte_val"] else "not run") + (
            " (other documents)" if c["same_documents"] is False else "")
        if not c["done"]:
            L.append(f"| {name} | 0/{c['planned']} | not run | not run | not run | not run | not run | {byte} | - | - "
                     "| - |")
            continue
        gap = "(reference)" if fam == REFERENCE else ("-" if c["gap"] is None else f"{c['gap']:+.2%}")
        bpt = f"{statistics.fmean(c['bytes_per_token']):.2f}" if c["bytes_per_token"] else "-"
        ep = f" ({statistics.fmean(c['epochs']):.2f} epochs)" if c["epochs"] else ""
        L.append(f"| {name} | {c['done']}/{c['planned']} | {fmt(c['val_ppl'], 2)} | {fmt(c['test_ppl'], 2)} | {gap} | "
                 f"{fmt(c['val'])} | {fmt(c['test'])} | {byte} | {bpt} | {', '.join(f'{x:.2g}' for x in c['lr'])} | "
                 f"{c['info'].replace(' tokens,', ' tokens' + ep + ',', 1)}, {'/'.join(c['tokenizers'])} |")
    return "\n".join(L).rstrip() + "\n"


def _mtok(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 100_000 else f"{n:,}"


def render_bpe(runs_dir: Path, plan: list) -> str:
    return bpe_markdown(bpe_table(load(runs_dir, plan), plan))


def render_retrieval(runs_dir: Path, plan: list) -> str:
    return retrieval_markdown(retrieval_table(load(runs_dir, plan), plan))


def render(runs_dir: Path, plan: list, *, plots_dir: Path | None, plots_rel: str = "results") -> str:
    records = load(runs_dir, plan)
    tables = study_tables(records, plan)
    n_done = sum(1 for r in plan if records.get(r.id, {}).get("status") == "done")
    plots, note = make_plots(tables, plots_dir, plots_rel) if plots_dir is not None else ([], "")
    start = study.ladder_rule(bool(plan) and plan[0].smoke)[0]
    n_ext = sum(r.kind == "sweep" and r.lr_factor not in start for r in plan)
    head = (f"{n_done} of {len(plan)} planned runs done ({sum(r.kind == 'sweep' for r in plan)} sweep runs"
            + (f" with {n_ext} ladder extension{'s' if n_ext > 1 else ''}" if n_ext else "") + ", "
            f"{sum(r.kind == 'study' for r in plan)} study runs, {sum(r.kind == 'bpe' for r in plan)} BPE runs); "
            f"records: `benchmarks/quality/runs/`; "
            f"regenerate with `python3 benchmarks/quality/report.py`.\n")
    return head + "\n" + markdown(tables, plots, note)


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    if begin in text and end in text:
        a, b = text.index(begin), text.index(end)
        return text[: a + len(begin)] + "\n" + block + text[b:]
    if begin != BEGIN and END in text:  # a new block goes right after the study's
        at = text.index(END) + len(END)
        return text[:at] + f"\n\n{begin}\n{block}{end}" + text[at:]
    return text.rstrip() + f"\n\n{begin}\n{block}{end}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="the --smoke plan and records")
    ap.add_argument("--print", action="store_true", help="print the block, write nothing")
    ap.add_argument("--page", type=Path, default=RESULTS_MD)
    args = ap.parse_args(argv)
    runs_dir = args.runs_dir or (study.DATA / "smoke_runs" if args.smoke else study.RUNS)
    plan = study.plan(smoke=args.smoke, runs_dir=runs_dir)  # with the sweep's ladder as the records have it
    if args.print:
        print(render(runs_dir, plan, plots_dir=None))
        print(render_retrieval(runs_dir, plan))
        print(render_bpe(runs_dir, plan))
        return 0
    block = render(runs_dir, plan, plots_dir=PLOTS if not args.smoke else study.DATA / "smoke_plots")
    text = replace_block(args.page.read_text() if args.page.exists() else "", block)
    text = replace_block(text, render_retrieval(runs_dir, plan), RBEGIN, REND)
    args.page.write_text(replace_block(text, render_bpe(runs_dir, plan), BBEGIN, BEND))
    print(f"report: {args.page} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
