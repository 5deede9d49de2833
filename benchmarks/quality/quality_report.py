#!/usr/bin/env python3
"""Turn the quality study's results into ``docs/results.md``, plots under ``docs/results/`` and
``docs/results/quality.json`` (every number of the page, per run, per configuration and per table).

Input: the folder ``quality_run.py all --out`` wrote (``study.json``, ``runs/<id>/result.json`` and
``metrics.jsonl``), one run per configuration and seed (``flash-1024-s1``).  Each configuration's
finished seeds are aggregated into ``mean ± spread`` (``quality_stats``: the definitions, the
equal-wall-time view and the verdict rules); runs that are missing, failed, killed or time-capped
are counted out and shown with their status.  A table none of whose configurations is in the
study is left out and said so.  ``--pending`` writes the page without results (method, commands,
the planned runs).

Sessions: a results folder may hold the runs of several calls (``quality_merge.py``): ``study.json``'s
``environment`` is the first session's, ``extra_sessions`` lists the later ones with their runs.
Every run is labelled with its session (A, B, ...) on the page and in quality.json; a table cell whose
timings mix sessions (training time, tokens/s, speed-up) is marked, since timings are comparable
only within a session.  A folder without ``extra_sessions`` is one session.

The page's hand-written notes (from a line starting with ``## Notes`` to the end) are kept when the
page is regenerated, unless their heading names a date (``YYYY-MM-DD``) on which none of the
study's sessions ran: notes about another study are dropped (and the command says so).

Usage::

    python3 benchmarks/quality/quality_report.py --results OUT        # -> docs/results.md, docs/results/
    python3 benchmarks/quality/quality_report.py --pending            # the page before any GPU run
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_plan import (  # noqa: E402
    CHUNK_CONTEXT,
    CONTEXT_MODELS,
    CONTEXTS,
    DEFAULT_TOKENS,
    MAIN_CONTEXT,
    MODELS,
    REFERENCE,
    SEEDS,
    build_plan,
    fits,
)
from quality_stats import (  # noqa: E402
    EQUAL_TIME_FRACTIONS,
    MATCH_TOL,
    NO_VERDICT,
    ROOT,
    SEED_BYTES_PER_TOKEN,
    SEED_GAP_PER_TOKEN,
    fmt,
    fmt_diff,
    fmt_stat,
    per_byte_change,
    summarise,
    tables,
    verdicts,
)

# the one-seed study this page replaced (2026-11-22: all three tables, 2^23 tokens, seed 0 with the
# initial weights shared across contexts): docs/results.md at this commit
ONE_SEED_PAGE = "c1508dd"


# ---------------------------------------------------------------------------------------------- loading


def load_results(results: Path) -> tuple[dict, dict[str, dict]]:
    """``(study, {run id: run record})``; a run record holds ``run``, ``status`` and, when present,
    ``train``, ``eval``, ``n_params`` and ``metrics`` (the rows of metrics.jsonl)."""
    study_path = results / "study.json"
    if not study_path.exists():
        raise SystemExit(f"quality_report: {study_path} not found (is {results} the --out of quality_run.py all?)")
    study = json.loads(study_path.read_text())
    runs: dict[str, dict] = {}
    for spec in study["plan"]:
        rid = spec["id"]
        folder = results / "runs" / rid
        rec = {"run": spec, "status": "missing"}
        if (folder / "result.json").exists():
            rec = json.loads((folder / "result.json").read_text())
            rec["run"] = spec
        rec["metrics"] = _read_jsonl(folder / "metrics.jsonl")
        runs[rid] = rec
    return study, runs


def sessions(study: dict) -> list[dict]:
    """The study's sessions in order (labels A, B, ...), each ``{label, environment, runs, note,
    replaced, superseded}``: the first is ``study["environment"]``, then the entries of
    ``study["extra_sessions"]`` (``{environment, runs, replaced, note}``, ``runs``: what that session
    ran).  A run counts for the last session that ran it: ``runs`` are the runs a session has on the
    page, ``superseded`` its runs that a later session ran again (``{run, status, by}``), ``replaced`` the earlier records
    (with their status) this session's replaced."""
    extras = study.get("extra_sessions") or []
    listed = {rid for e in extras for rid in e["runs"]}
    owner = {p["id"]: 0 for p in study["plan"] if p["id"] not in listed}
    superseded: dict[int, list[dict]] = {}
    for i, e in enumerate(extras, start=1):
        for rid, st in (e.get("replaced") or {}).items():  # not owned yet: the first session's
            superseded.setdefault(owner.get(rid, 0), []).append({"run": rid, "status": st, "by": chr(ord("A") + i)})
        owner.update({rid: i for rid in e["runs"]})
    order = [p["id"] for p in study["plan"]]
    out = []
    for i, e in enumerate([{"environment": study["environment"], "note": study["environment"].get("runs_selected")}]
                          + list(extras)):
        out.append({"label": chr(ord("A") + i), "environment": e["environment"],
                    "runs": [rid for rid in order if owner.get(rid) == i], "note": e.get("note"),
                    "replaced": e.get("replaced") or {}, "superseded": superseded.get(i, [])})
    return out


def session_of(study: dict) -> dict[str, str]:
    """``{run id: session label}``."""
    return {rid: s["label"] for s in sessions(study) for rid in s["runs"]}


def describe_session(s: dict) -> str:
    """One line: where and when a session ran, with which software."""
    env = s["environment"]
    devs = env.get("devices") or ["?"]
    names = sorted(set(devs))
    kind = ", ".join(f"{devs.count(n)}x {n}" for n in names)
    slots = len(env.get("slots") or devs)
    return (f"{env['date_utc']} UTC on {kind} ({slots} used, one run per device at a time; "
            f"{env.get('host_cpus', '?')} host CPUs); torch {env['torch']}, CUDA {env.get('cuda')}, Triton "
            f"{env.get('triton')}, Python {env['python']}"
            + (f", driver {env['driver']}" if env.get("driver") else "")
            + f", lintime commit {(env.get('git_commit') or 'unknown')[:12]}")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a row cut by a kill
    return rows


# ---------------------------------------------------------------------------------------------- page


CROSS = "†"
ENDED = "‡"


def cross(r: dict) -> bool:
    """The row's seeds and its Transformer++ reference ran in more than one session (its timings
    mix machines or calls)."""
    return bool(r.get("n_ok")) and len(set(r.get("sessions") or []) | set(r.get("ref_sessions") or [])) > 1


def xmark(r: dict) -> str:
    return f" {CROSS}" if cross(r) else ""


def cross_note(rows: list[dict], sess: list[dict]) -> list[str]:
    """The footnote under a table with cross-session cells (nothing when there are none)."""
    marked = [r for r in rows if cross(r)]
    if not marked:
        return []
    used = sorted({x for r in marked for x in set(r["sessions"]) | set(r["ref_sessions"])})
    where = {x["label"]: x for x in sess}
    kinds = {frozenset(where[x]["environment"].get("devices") or []) for x in used if x in where}
    gpu = ("the GPU is the same kind but the host and the number of runs at a time may differ" if len(kinds) == 1
           else "the GPU kinds differ")
    return ["", f"{CROSS} the row's seeds or its Transformer++ reference ran in sessions "
            + ", ".join(f"{x} ({_short(where.get(x))})" for x in used)
            + f": training time and tokens/s are comparable within a session; across sessions {gpu}, so these "
            "times, tokens/s and speed-ups are approximate (bits per byte and speed-ups in steps are not affected)."]


def _short(s: dict | None) -> str:
    if s is None:
        return "?"
    devs = s["environment"].get("devices") or ["?"]
    return f"{len(devs)}x {sorted(set(devs))[0]}, {s['environment']['date_utc'][:16]} UTC"


def status_mark(r: dict) -> str:
    st = r.get("status", "missing")
    return "" if st == "ok" else f" **[{st}]**"


def fmt_speedup(r: dict, key: str = "speedup_time") -> str:
    if not r.get("n_ok"):
        return "-"
    if not r.get("ref_available"):
        return "no reference"
    sp = r[key]
    if not sp["n"]:
        return "not reached"
    text = f"{sp['mean']:.2f}x" + (f" ± {sp['spread']:.2f}" if sp["n"] >= 2 else "")
    return text if r["reached"] == r["n_ok"] else f"{text} ({r['reached']} of {r['n_ok']} seeds reach it)"


def fmt_vs(d: dict) -> str:
    if d.get("mean") is None:
        return "-"
    if d["beyond"] is None:
        return f"{fmt_diff(d)}"
    return f"{fmt_diff(d)} ({'beyond' if d['beyond'] else 'within'} the spread)"


METHOD = """\
## What is measured

* **Corpus** (text nobody in this project wrote): the Linux kernel's `Documentation/` tree from
  Debian's `linux-doc` package plus the Python standard library's `.py` files, one document per file,
  byte-level (vocabulary 260: the 256 bytes and `<pad> <bos> <eos> <mask>`).
  `benchmarks/quality/prepare_data.py` builds it; the split is lintime's path-hash rule (5 %
  validation, 5 % test: `docs/data.md`), so it is fixed by the file paths and identical for every run.
  The test split is never looked at.{corpus_here}
* **Models**: the `-medium` presets (d = 512, byte vocabulary, 25-29M parameters): FLASH and FLASH-Quad
  (16 GAU layers, s = 128, FLASH C = 256), Transformer++ / Transformer+ (8 blocks, 8 heads), GLA
  (8 blocks, 4 heads), Transformer-VQ (16 units, S = 512 codes, L = 256), the linear-attention GPT
  (8 GPT-2 blocks, learned positions up to 8192) and Performer (8 blocks, ReLU features, 128 per
  head); `lintime presets` lists them with their exact counts.
* **Training**: `lintime.training.train` (what `lintime train` runs), each family with its seed's
  recipe (`flash` for FLASH, FLASH-Quad, Transformer+/++, linear GPT and Performer; `gla` for GLA;
  `vq` for Transformer-VQ: `lintime/training/config.py`), equal tokens and equal context within
  every table, {tokens_desc}, packed documents (no attention across documents), bf16 autocast on
  the GPU.  This is about 1/{budget_ratio:,.0f} of the seed's budget (125K steps of 2^18 tokens): every
  number here is "at this budget, on this corpus".
* **Seeds**: every configuration runs with seeds {seeds} (run `flash-1024-s1` is FLASH at context
  1024, seed 1).  The seed `s` orders the data (every model of seed `s` at one context sees the same
  batches); the initial weights come from `lintime train --init-seed`, set to the CRC-32 of the run
  id, so no two runs share an initial draw (not two contexts of one preset, not two seeds).
* **Spread**: a cell `m ± s` is the mean and the sample standard deviation (n - 1) over the
  configuration's finished seeds (`lintime.evaluation.units.mean_spread`); `(n=2)` marks a cell with
  fewer seeds than planned, `(1 seed)` one with no spread.  Two configurations **differ** only when
  `|mean_a - mean_b| > s_a + s_b` (`lintime.evaluation.units.differs`).
* **Validation curves**: bits per byte every 1/16 of a run on the first {curve_tokens:,} validation
  tokens (the same tokens every time).  **Final scores** (`lintime.evaluation.evaluate`): the first
  ~{final_tokens:,} validation tokens (whole documents), at the training context and at 2x and 4x it.
* **Training time**: the trainer's time for the optimiser steps (no validation), with step 1 and every
  step slower than 3 median steps counted at the median step time (the excess, the "one-off" column,
  is CUDA start-up, Triton compiles and autotuning, paid by whichever run of a family first ran on a
  GPU; the same excess is taken out of the curves' times).
* **Speed-up** (seed Table 3): Transformer++'s mean training time at the same context and tokens over
  the time at which a seed's validation curve first reaches Transformer++'s mean final validation
  bits per byte (interpolated between evaluation points), mean ± spread over the seeds that reach it.
* **Equal wall time**: each seed's validation bits per byte at {fractions} of Transformer++'s mean
  training time (interpolated on its curve).  A run that ended earlier counts with its final value
  (marked {ended}): more time would have lowered it.  A slower model is caught mid-schedule (its
  learning rate has not decayed yet), which favours the faster models: a run planned for that time
  would do better.
* **Units**: bits per byte throughout.  The seed reports per-**token** perplexity (SentencePiece on
  Wiki-40B); a relative perplexity change per byte is `(1 + r_token) ** (1 / b) - 1` at `b` bytes per
  token (`lintime.evaluation.units.per_byte_change`).  This page uses b = {bpt:g}, an estimate for
  32k-subword vocabularies on English text, not measured on Wiki-40B (no copy here): the seed's
  Table 5 bound of ~{gap_tok:.1f} % per token is {gap_byte:.2f} % per byte at b = {bpt:g} ({gap_3:.2f} % at b = 3,
  {gap_5:.2f} % at b = 5).
* **Verdicts** against the seed's claims: a claim is a bound on a difference `d ± S` (S: the summed
  spreads); the verdict says on which side of the bound the whole interval lies, and is
  "{no_verdict}" when it straddles the bound or a side has fewer than two seeds.  "Matches" for quality
  means `|d| + S` within {tol:.0f} % of Transformer++'s bits per byte.
"""


def corpus_line(c: dict | None) -> str:
    """This study's copy of the corpus (package and Python versions, sizes), from ``corpus.json``."""
    if not c or "parts" not in c:
        return ""
    ld, py = c["parts"].get("linux-doc", {}), c["parts"].get("python-stdlib", {})
    sp = c.get("splits") or {}
    return (f"  This study's copy: `linux-doc` {ld.get('version') or ld.get('package', '?')} ({ld.get('files', 0):,} "
            f"files) and Python {py.get('python', '?')}'s standard library ({py.get('files', 0):,} files); "
            + ", ".join(f"{k} {v['tokens']:,} bytes" for k, v in sp.items() if k in ("train", "validation"))
            + (f"; content sha256 {c['content_sha256'][:12]}" if c.get("content_sha256") else "") + ".")


def regenerate_block(tokens: int, seeds: list[int], tables_: list[str]) -> str:
    env = f"TOKENS={tokens}" + ("" if list(seeds) == list(SEEDS) else f" SEEDS={','.join(map(str, seeds))}") \
        + ("" if tables_ == ["main"] else f" TABLES={','.join(tables_)}")
    return f"""\
## Regenerate

```bash
# 1. data (here, with network): corpus + token cache + the archive the GPU machine gets (~12 MiB)
apt-get update && apt-get install -y linux-doc
python3 benchmarks/quality/prepare_data.py
# 2. the plan and its predicted cost on N GPUs against the call's deadline
python3 benchmarks/quality/quality_plan.py --gpus 3 --deadline-s 540
# 3. the runs (one call; carry benchmarks/quality/data/quality_data.tar.xz; GPU_IDS picks the GPUs)
OUT=quality_out {env} GPU_IDS=0,1,2 DEADLINE_S=540 bash benchmarks/quality/gpu_quality.sh
#    (MODE=smoke-gpu first checks every configuration in a few steps per run; on a CPU:
#     python3 benchmarks/quality/quality_run.py all --out /tmp/q --mode smoke)
#    runs left out or failed, or more seeds: a later call with ONLY=id,group or SEEDS=3,4 (OUT=quality_out2),
#    then merged as a second session (checks that corpus, tokens and plan entries agree):
#    python3 benchmarks/quality/quality_merge.py --into quality_out --add quality_out2 --note "why it ran"
# 4. this page, the plots and quality.json from the results folder
python3 benchmarks/quality/quality_report.py --results quality_out
```
"""


def page(study: dict | None, summ: dict[str, dict] | None, t: dict | None, made: list[str], tokens: int) -> str:
    lines = ["# Results: quality on real text", ""]
    sess = sessions(study) if study is not None else []
    env = study["environment"] if study is not None else {}
    seeds = list(env.get("seeds") or sorted({s["seed"] for s in (summ or {}).values()}) or SEEDS)
    tables_ = list(env.get("tables") or ["main", "context", "chunk"]) if study is not None else ["main"]
    plan = build_plan("full", tokens=tokens, seeds=tuple(seeds) if study is not None else SEEDS,
                      tables=tuple(tables_))
    seeds_text = ", ".join(map(str, seeds))
    if study is None:
        lines += ["**Status: not yet run on a GPU.**  This page holds the method and the commands; the tables, "
                  "plots and `docs/results/quality.json` are generated from the GPU results by the last "
                  "command below.  No number on this page has been measured yet.", ""]
    elif len(sess) > 1:
        lines += [f"Measured in {len(sess)} sessions (the same corpus, plan and tokens per run; seeds {seeds_text}; "
                  f"mode `{env['mode']}`).  All numbers are in `docs/results/quality.json`.", ""]
        for x in sess:
            repl = ("; replaces the record(s) " + ", ".join(f"`{k}` ({v})" for k, v in x["replaced"].items())
                    if x["replaced"] else "")
            sup = "".join(f"; `{r['run']}` ({r['status']} here) ran again in session {r['by']}" for r in x["superseded"])
            lines.append(f"* **Session {x['label']}** ({len(x['runs'])} runs on this page{sup}): {describe_session(x)}"
                         + (f".  {x['note']}" if x.get("note") else "") + f"{repl}.")
        lines += ["", "Each run's session is in the Runs table.  Training time and tokens/s are comparable within a "
                  f"session; cells whose timings mix sessions are marked {CROSS}.", ""]
    else:
        lines += [f"Measured {env['date_utc']} UTC on {', '.join(sorted(set(env['devices'])))} "
                  f"({len(env['slots'])} used, one run per device at a time); torch {env['torch']}, "
                  f"CUDA {env.get('cuda')}, Triton {env.get('triton')}, Python {env['python']}, lintime commit "
                  f"{(env.get('git_commit') or 'unknown')[:12]}; mode `{env['mode']}`; seeds {seeds_text}.  "
                  "All numbers are in `docs/results/quality.json`.", ""]
    if study is not None and env["mode"] != "full":
        lines += [f"**This is a `{env['mode']}` run: a pipeline check with a few steps per run.  Its numbers "
                  "say nothing about the models.**", ""]
    r0 = plan[0] if plan else None
    steps = r0.steps if r0 else 0
    lines += [METHOD.format(
        tokens_desc=f"{tokens / 2**20:g} Mi tokens per run ({steps} steps of {r0.tokens_per_batch if r0 else 0:,} tokens)",
        budget_ratio=125_000 * 2**18 / tokens, seeds=seeds_text,
        curve_tokens=r0.curve_eval_tokens if r0 else 0, final_tokens=r0.final_eval_tokens if r0 else 0,
        fractions=" / ".join(f"{f:g}" for f in EQUAL_TIME_FRACTIONS), ended=ENDED, bpt=SEED_BYTES_PER_TOKEN,
        gap_tok=100 * SEED_GAP_PER_TOKEN, gap_byte=100 * per_byte_change(SEED_GAP_PER_TOKEN, SEED_BYTES_PER_TOKEN),
        gap_3=100 * per_byte_change(SEED_GAP_PER_TOKEN, 3.0), gap_5=100 * per_byte_change(SEED_GAP_PER_TOKEN, 5.0),
        no_verdict=NO_VERDICT, tol=100 * MATCH_TOL, corpus_here=corpus_line(env.get("corpus"))),
        regenerate_block(tokens, seeds, tables_)]
    if study is None:
        f = fits(plan, 3, 540)
        lines += ["## Not yet run on a GPU", "",
                  f"The study is {len(plan)} runs, predicted at {f['gpu_s']:,.0f} GPU-seconds ({f['makespan_s']:.0f} s "
                  "on three GPUs: `quality_plan.py`).  Planned runs:", "",
                  "| run | preset | recipe | context | tokens | steps | seed | init seed | tables |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in plan:
            lines.append(f"| `{r.id}` | `{r.preset}` | {r.recipe} | {r.context_len} | {r.tokens / 2**20:g} Mi | "
                         f"{r.steps} | {r.seed} | {r.init_seed} | {', '.join(r.tables)} |")
        lines.append("")
        return "\n".join(lines)
    assert summ is not None and t is not None
    n_of = len(seeds)
    multi = len(sess) > 1
    lines += ["## Runs", "", "| run | seed | init seed | preset |" + (" session |" if multi else "")
              + " status | params | tokens | steps | training time (s) | one-off (s) | tokens/s | peak memory (GiB) |",
              "|---|---|---|---|" + ("---|" if multi else "") + "---|---|---|---|---|---|---|---|"]
    for s in summ.values():
        rebuilt = " (record rebuilt)" if s.get("reconstructed") else ""
        lines.append(f"| `{s['id']}` | {s['seed']} | {fmt(s['init_seed'], 'd')} | `{s['preset']}` |"
                     + (f" {s['session']} |" if multi else "")
                     + f" {s['status']}{rebuilt}{' (' + s['error'][:80] + ')' if s.get('error') else ''} "
                     f"| {fmt(s['n_params'] and s['n_params'] / 1e6, '.2f') + 'M' if s['n_params'] else '-'} "
                     f"| {s['tokens'] / 1e6:.2f}M | {s['steps']} | {fmt(s['train_s_adjusted'], '.1f')} "
                     f"| {fmt(s['startup_s'], '.1f')} | {fmt(s['tokens_per_s'], ',.0f')} | {fmt(s['peak_memory_gib'], '.1f')} |")
    if any(s.get("reconstructed") for s in summ.values()):
        lines += ["", "Record rebuilt: the run's result.json was rebuilt from its metrics.jsonl and the driver's summary "
                  "line (its own did not come back from the device); peak memory is unknown for those runs."]
    ref_name = MODELS[REFERENCE][0]
    lines += ["", f"## Main table: context {MAIN_CONTEXT} (equal tokens)", "",
              f"Mean ± spread over the finished seeds.  The difference to {ref_name} counts only beyond the summed "
              "spreads.", "",
              f"| model | seeds | bits/byte (final eval) | minus {ref_name} | last curve point | training time (s) "
              f"| tokens/s | speed-up to {ref_name} (time) | (steps) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m, r in t["main"].items():
        if r.get("status") == "not in plan":
            continue
        vs = "(reference)" if m == REFERENCE else fmt_vs(t["main_vs_ref"][m])
        sp = ("(reference)", "(reference)") if m == REFERENCE else (fmt_speedup(r) + xmark(r),
                                                                      fmt_speedup(r, "speedup_steps"))
        lines.append(f"| {MODELS[m][0]}{status_mark(r)} | {r['n_ok']}/{r['n']} | {fmt_stat(r['bpb'], of=n_of)} | {vs} "
                     f"| {fmt_stat(r['final_val_bpb'], of=n_of)} | {fmt_stat(r['train_s'], '.1f', n_of)}{xmark(r)} "
                     f"| {fmt_stat(r['tokens_per_s'], ',.0f', n_of)}{xmark(r)} | {sp[0]} | {sp[1]} |")
    lines += cross_note(list(t["main"].values()), sess)
    lines.append("")
    lines += [f"![{n}](results/{n})" for n in made if n.startswith("bpb_vs")]
    eq = t.get("equal_time")
    if eq:
        fr = eq["fractions"]
        lines += ["", f"## Equal wall time: context {eq['context']}", "",
                  f"Validation bits per byte each model had reached at the same training time: fractions of "
                  f"{ref_name}'s mean training time ({eq['t_ref']:.1f} s, its final {fmt_stat(eq['ref_final'])}).  "
                  f"{ENDED}: some seeds had ended by then (their final value counts; more time would lower it); "
                  "\"-\": no evaluation yet.  Timings are of one session's GPUs"
                  + (" (see the sessions above: they may mix)" if multi else "") + ".", "",
                  "| model | " + " | ".join(f"at {f:g} x ({f * eq['t_ref']:.1f} s)" for f in fr) + " |",
                  "|---|" + "---|" * len(fr)]
        for m, cells in eq["rows"].items():
            lines.append(f"| {MODELS[m][0]} | " + " | ".join(
                fmt_stat(cells[f], of=n_of) + (f" {ENDED}" if cells[f]["ended"] else "") for f in fr) + " |")
        lines.append("")
        lines += [f"![{n}](results/{n})" for n in made if n.startswith("equal_time")]
    if "context" in t:
        lines += ["", "## Context length (seed Table 3, Figures 5-6)", "",
                  "| model | " + " | ".join(f"{c}: bits/byte" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
        for m in CONTEXT_MODELS:
            lines.append(f"| {MODELS[m][0]} | " + " | ".join(
                fmt_stat(t["context"][m][c].get("bpb"), of=n_of) + status_mark(t["context"][m][c]) for c in CONTEXTS) + " |")
        lines += ["", "| model | " + " | ".join(f"{c}: time (s)" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
        for m in CONTEXT_MODELS:
            lines.append(f"| {MODELS[m][0]} | " + " | ".join(
                fmt_stat(t["context"][m][c].get("train_s"), ".1f", n_of) + xmark(t["context"][m][c]) for c in CONTEXTS) + " |")
        lines += ["", "| model | " + " | ".join(f"{c}: speed-up" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
        for m in CONTEXT_MODELS:
            lines.append(f"| {MODELS[m][0]} | " + " | ".join(
                fmt_speedup(t["context"][m][c]) + xmark(t["context"][m][c]) for c in CONTEXTS) + " |")
        lines += cross_note([t["context"][m][c] for m in CONTEXT_MODELS for c in CONTEXTS], sess)
        lines.append("")
        lines += [f"![{n}](results/{n})" for n in made if n.startswith("context_")]
    if t["gap"]:
        lines += ["", "## FLASH-Quad -> FLASH (seed Table 5)", "",
                  "Seed (LM, Wiki-40B, per-token perplexity points): -0.05 / 0.06 / 0.22 / 0.30 / 0.11 at 512 / 1k / 2k "
                  f"/ 4k / 8k, under ~{100 * SEED_GAP_PER_TOKEN:.1f} % per token = "
                  f"{100 * per_byte_change(SEED_GAP_PER_TOKEN, SEED_BYTES_PER_TOKEN):.2f} % per byte at "
                  f"{SEED_BYTES_PER_TOKEN:g} bytes/token.  The gap's spread is the two models' summed spreads.", "",
                  "| context | FLASH-Quad | FLASH | gap (bits/byte) | per-byte perplexity change | "
                  f"the same per token ({SEED_BYTES_PER_TOKEN:g} bytes/token) |", "|---|---|---|---|---|---|"]
        for c, g in t["gap"].items():
            rng = g["ppl_increase_pct_range"]
            lines.append(f"| {c} | {fmt_stat(g['flash_quad'], of=n_of)} | {fmt_stat(g['flash'], of=n_of)} "
                         f"| {fmt_vs(g['gap_bpb'])} | {fmt(g['ppl_increase_pct'], '+.2f')} %"
                         + (f" ({rng[0]:+.2f} to {rng[1]:+.2f})" if rng and g["gap_bpb"]["n"] >= 2 else "")
                         + f" | {fmt(g['per_token_pct'], '+.2f')} % |")
    if "chunk" in t:
        lines += ["", f"## Chunk size (seed Figure 8), context {CHUNK_CONTEXT}", "",
                  f"| C | seeds | bits/byte | training time (s) | tokens/s | speed-up to {ref_name} |", "|---|---|---|---|---|---|"]
        for C, r in t["chunk"].items():
            lines.append(f"| {C}{status_mark(r)} | {r.get('n_ok', 0)}/{r.get('n', 0)} | {fmt_stat(r.get('bpb'), of=n_of)} "
                         f"| {fmt_stat(r.get('train_s'), '.1f', n_of)}{xmark(r)} "
                         f"| {fmt_stat(r.get('tokens_per_s'), ',.0f', n_of)}{xmark(r)} | {fmt_speedup(r)}{xmark(r)} |")
        lines += cross_note(list(t["chunk"].values()), sess)
        if "chunk_size.png" in made:
            lines += ["", "![chunk_size.png](results/chunk_size.png)"]
    lines += ["", "## Length extrapolation (evaluated at 2x and 4x the training context)", "",
              "| configuration | trained at | seeds | bits/byte 1x | 2x | 4x | 4x minus 1x |", "|---|---|---|---|---|---|---|"]
    for gid, e in t["extrapolation"].items():
        b = e["bpb"]
        skipped = "; ".join(e["skipped"])
        lines.append(f"| `{gid}` | {e['context_len']} | {e['n']} | {fmt_stat(b[1], of=n_of)} "
                     f"| {fmt_stat(b[2], of=n_of) if b[2]['n'] else 'n/a'} | {fmt_stat(b[4], of=n_of) if b[4]['n'] else 'n/a'} "
                     f"| {fmt_stat(e['delta_4x'], '+.4f', n_of)}{' (' + skipped + ')' if skipped else ''} |")
    if "extrapolation.png" in made:
        lines += ["", "![extrapolation.png](results/extrapolation.png)"]
    missing = [x for x in ("context", "chunk") if x not in t]
    if missing:
        extra = [r for r in build_plan("full", tokens=tokens, seeds=tuple(seeds), tables=("main", *missing))
                 if "main" not in r.tables]
        lines += ["", "## Not in this study", "",
                  f"The {' and '.join({'context': 'context-length', 'chunk': 'chunk-size'}[x] for x in missing)} "
                  f"table{'s' if len(missing) > 1 else ''} (seed Table 3 at other lengths, Figure 8) "
                  f"{'are' if len(missing) > 1 else 'is'} not in this study: `TABLES=main,{','.join(missing)}` adds "
                  f"{len(extra)} runs at these seeds and tokens, predicted at {fits(extra, 1, math.inf)['gpu_s']:,.0f} "
                  "GPU-seconds.  An earlier one-seed study of all three tables (2026-11-22, 2^23 tokens per run, seed 0 "
                  f"with the initial weights shared across contexts) is this page at git commit {ONE_SEED_PAGE}; "
                  "with one seed none of its differences carries a verdict."]
    lines += ["", "## Against the seed's claims", "",
              f"Only claims this study's configurations test.  \"{NO_VERDICT}\": the difference does not clear the "
              "spread (or fewer than two seeds).  A verdict holds for this budget only: with runs this short it "
              "compares how fast the models start to learn under their recipes, not the converged quality the seed "
              "reports (125K steps); it says nothing about the seed's claims at its own budget.", "",
              "| claim (seed) | verdict | measured (mean ± spread) |",
              "|---|---|---|"]
    for v in verdicts(t, summ):
        lines.append(f"| {v['claim']} | **{v['verdict']}** | {v['measured']} |")
    lines.append("")
    return "\n".join(lines)


NOTES_HEADING = "## Notes"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def hand_notes(doc: Path, dates: set[str] | None = None) -> tuple[str, str | None]:
    """The hand-written part of an existing page: from its first line starting with ``## Notes`` to
    the end (``""`` when there is none), and the heading of notes dropped because it names a date
    not in ``dates`` (the study's session dates; ``None``: keep any)."""
    if not doc.exists():
        return "", None
    lines = doc.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(NOTES_HEADING)), None)
    if start is None:
        return "", None
    named = set(_DATE.findall(lines[start]))
    if dates is not None and named and not named & dates:
        return "", lines[start].strip()
    return "\n" + "".join(lines[start:]), None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, help="the --out folder of quality_run.py all")
    ap.add_argument("--pending", action="store_true", help="write the page without results")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--assets", type=Path, default=None, help="plots and quality.json (default: <doc folder>/results)")
    ap.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens per run (for --pending)")
    args = ap.parse_args(argv)
    if args.pending == (args.results is not None):
        ap.error("give --results DIR or --pending")
    assets = args.assets or args.doc.parent / "results"
    if args.pending:
        args.doc.write_text(page(None, None, None, [], args.tokens))
        print(f"quality_report: wrote {args.doc} (pending)")
        return 0
    from quality_plots import plots

    study, runs = load_results(args.results)
    summ = summarise(runs, session_of(study))
    t = tables(summ)
    assets.mkdir(parents=True, exist_ok=True)
    for old in assets.glob("*.png"):  # plots of tables this study does not have must not linger
        if old.name in STUDY_PLOTS:
            old.unlink()
    made = plots(summ, t, assets)
    tokens = study["environment"].get("tokens_per_run", args.tokens)
    data = {"environment": study["environment"], "sessions": sessions(study), "plan": study["plan"], "runs": summ,
            "tables": t, "verdicts": verdicts(t, summ), "plots": made,
            "units": {"seed_bytes_per_token": SEED_BYTES_PER_TOKEN, "seed_gap_per_token": SEED_GAP_PER_TOKEN},
            "spread": "sample standard deviation over seeds (n - 1); differ when |mean_a - mean_b| > s_a + s_b"}
    (assets / "quality.json").write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    dates = {x["environment"]["date_utc"][:10] for x in sessions(study)}
    notes, dropped = hand_notes(args.doc, dates)
    args.doc.write_text(page(study, summ, t, made, tokens) + notes)
    print(f"quality_report: wrote {args.doc}, {assets / 'quality.json'} and {len(made)} plots"
          + (" (hand-written notes kept)" if notes else "")
          + (f" (dropped the notes '{dropped}': they name another study's date)" if dropped else ""))
    return 0


# every plot name this report has written (current and earlier layouts), cleared before a regeneration
STUDY_PLOTS = {"bpb_vs_steps_1024.png", "bpb_vs_time_1024.png", "equal_time_1024.png", "context_bpb.png",
               "context_bpb_vs_steps.png", "context_bpb_vs_time.png", "chunk_size.png", "extrapolation.png"}


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(type(x).__name__)


if __name__ == "__main__":
    sys.exit(main())
