#!/usr/bin/env python3
"""Turn the quality study's results into ``docs/results.md``, plots under ``docs/results/`` and
``docs/results/quality.json`` (every number of the page, per run and per table).

Input: the folder ``quality_run.py all --out`` wrote (``study.json``, ``runs/<id>/result.json`` and
``metrics.jsonl``).  Runs that are missing, failed, killed or time-capped are shown with their
status; every table is computed from whatever finished, and a table whose reference run is
missing says so instead of a number.  ``--pending`` writes the page without results (method,
commands, the planned runs).

Definitions (also stated on the page):

* **training time**: the trainer's ``time_s`` (optimiser steps only, no validation), with step 1
  counted at the median step time: its excess is one-off start-up (CUDA context, Triton compiles),
  paid by whichever run of a family started first on a machine;
* **speed-up** (seed Table 3): ``T_ref / t_reach``, the reference (Transformer++ at the same context
  and tokens) run's training time over the time at which the model's validation curve first
  reaches the reference's final validation bits per byte (linear interpolation between evaluation
  points); the same with steps.  "not reached" when its curve never gets there;
* **FLASH-Quad -> FLASH gap** (seed Table 5): bits per byte of FLASH minus FLASH-Quad, and the
  per-byte perplexity increase ``2**gap - 1``;
* **extrapolation**: final bits per byte at 2x and 4x the training context (``lintime.evaluation``:
  windows aligned to document starts, no state carried).

Sessions: a results folder may hold the runs of several calls (``quality_merge.py``): ``study.json``'s
``environment`` is the first session's, ``extra_sessions`` lists the later ones with their runs.
Every run is labelled with its session (A, B, ...) on the page and in quality.json; a table cell that
compares runs of different sessions (training time, tokens/s, speed-up) is marked, since timings are
comparable only within a session.  A folder without ``extra_sessions`` is one session.

The page's hand-written notes (from a line starting with ``## Notes`` to the end) are kept when
the page is regenerated with ``--results``.

Usage::

    python3 benchmarks/quality/quality_report.py --results OUT        # -> docs/results.md, docs/results/
    python3 benchmarks/quality/quality_report.py --pending            # the page before any GPU run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_plan import (  # noqa: E402
    CHUNK_CONTEXT,
    CHUNK_SIZES,
    CONTEXT_MODELS,
    CONTEXTS,
    MAIN_CONTEXT,
    MODELS,
    REFERENCE,
    build_plan,
)

ROOT = HERE.parent.parent
MATCH_TOL = 0.01  # |bpb difference| <= 1 % of the reference's bpb counts as "matches"
# seed Table 5 (LM, Wiki-40B): +0.06 to +0.30 perplexity points on ~20-25, i.e. <= ~1.5 % *per token*;
# the gap measured here is per byte: compare with the bound converted (lintime.evaluation.units)
SEED_GAP_PER_TOKEN = 0.015


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


# ---------------------------------------------------------------------------------------------- numbers


def startup_offset(metrics: list[dict]) -> float:
    """Seconds of one-off start-up in step 1: its time minus the median step time (>= 0)."""
    times = [(r["step"], r["time_s"]) for r in metrics if "time_s" in r and "loss" in r]
    if len(times) < 3 or times[0][0] != 1:
        return 0.0
    dts = [b[1] - a[1] for a, b in zip(times, times[1:]) if b[0] == a[0] + 1]
    if not dts:
        return 0.0
    return max(times[0][1] - statistics.median(dts), 0.0)


def val_curve(metrics: list[dict]) -> list[dict]:
    """Evaluation points ``{step, tokens, time_s (start-up removed), bpb}`` in step order."""
    off = startup_offset(metrics)
    pts = [{"step": r["step"], "tokens": r["tokens"], "time_s": max(r["time_s"] - off, 0.0), "bpb": r["val_bpb"]}
           for r in metrics if r.get("val_bpb") is not None]
    return sorted(pts, key=lambda p: p["step"])


def first_reach(curve: list[dict], target: float, key: str) -> float | None:
    """``key`` (``time_s`` / ``step``) at which ``curve`` first reaches ``bpb <= target``, linearly
    interpolated between the two evaluation points around the crossing; ``None`` if never."""
    prev = None
    for p in curve:
        if p["bpb"] <= target:
            if prev is None:
                return float(p[key])
            f = (prev["bpb"] - target) / (prev["bpb"] - p["bpb"])
            return prev[key] + f * (p[key] - prev[key])
        prev = p
    return None


def speedup(curve: list[dict], ref_curve: list[dict]) -> dict:
    """Seed Table 3's speed-up of a model over the reference: ``{time, steps}`` (None: not
    reached), with ``target`` the reference's final bpb."""
    if not curve or not ref_curve:
        return {"time": None, "steps": None, "target": None}
    end = ref_curve[-1]
    out = {"target": end["bpb"]}
    for key, name in (("time_s", "time"), ("step", "steps")):
        t = first_reach(curve, end["bpb"], key)
        out[name] = (end[key] / t) if t else None
    return out


def summarise(runs: dict[str, dict], session: dict[str, str] | None = None) -> dict[str, dict]:
    """Per run: the numbers every table reads (``session``: run id -> session label, default A)."""
    out = {}
    for rid, rec in runs.items():
        spec, tr = rec["run"], rec.get("train") or {}
        curve = val_curve(rec["metrics"])
        evals = {r["context_len"]: r for r in (rec.get("eval") or {}).get("results", [])}
        off = startup_offset(rec["metrics"])
        train_s = tr.get("elapsed_s")
        out[rid] = {
            "id": rid, "model": spec["model"], "name": MODELS[spec["model"]][0], "preset": spec["preset"],
            "recipe": spec["recipe"], "context_len": spec["context_len"], "chunk_size": spec.get("chunk_size"),
            "status": rec.get("status", "missing"), "error": rec.get("error"), "n_params": rec.get("n_params"),
            "session": (session or {}).get(rid, "A"), "reconstructed": bool(rec.get("reconstructed")),
            "planned_tokens": spec["tokens"], "tokens": tr.get("tokens") or (curve[-1]["tokens"] if curve else 0),
            "steps": tr.get("steps") or (curve[-1]["step"] if curve else 0),
            "train_s": train_s, "startup_s": off, "train_s_adjusted": (train_s - off) if train_s else None,
            "tokens_per_s": (tr["tokens"] / (train_s - off)) if train_s and train_s > off else None,
            "final_val_bpb": curve[-1]["bpb"] if curve else None,
            "eval_bpb": {int(L): r.get("bits_per_byte") for L, r in evals.items()},
            "eval_skipped": {int(L): r["skipped"] for L, r in evals.items() if r.get("skipped")},
            "peak_memory_gib": rec.get("peak_memory_gib"), "curve": curve,
            "loss": [[r["step"], r["time_s"] - off, r["loss"]] for r in rec["metrics"] if "loss" in r],
        }
    return out


def ok(s: dict | None) -> bool:
    return s is not None and s["status"] == "ok"


def usable(s: dict | None) -> bool:
    """Has a curve (finished, time-capped or killed part-way)."""
    return s is not None and bool(s["curve"])


def tables(summ: dict[str, dict]) -> dict:
    """All tables as data (what quality.json stores and the page prints)."""
    def run(model: str, ctx: int) -> dict | None:
        return summ.get(f"{model}-{ctx}")

    def row(s: dict | None, ref: dict | None) -> dict:
        if s is None:
            return {"status": "not in plan"}
        sp = speedup(s["curve"], ref["curve"]) if usable(s) and usable(ref) else {"time": None, "steps": None}
        return {"id": s["id"], "status": s["status"], "bpb": s["eval_bpb"].get(s["context_len"]),
                "final_val_bpb": s["final_val_bpb"], "train_s": s["train_s_adjusted"], "tokens_per_s": s["tokens_per_s"],
                "tokens": s["tokens"], "steps": s["steps"], "n_params": s["n_params"],
                "speedup_time": sp["time"], "speedup_steps": sp["steps"],
                "ref_available": usable(ref), "session": s["session"],
                "ref_session": ref["session"] if ref is not None else None}

    main = {m: row(run(m, MAIN_CONTEXT), run(REFERENCE, MAIN_CONTEXT)) for m in MODELS}
    context = {m: {ctx: row(run(m, ctx), run(REFERENCE, ctx)) for ctx in CONTEXTS} for m in CONTEXT_MODELS}
    gap = {}
    for ctx in CONTEXTS:
        q, f = run("flash-quad", ctx), run("flash", ctx)
        bq = q["eval_bpb"].get(q["context_len"]) if ok(q) else None  # context_len: ctx / 8 in the CPU smoke
        bf = f["eval_bpb"].get(f["context_len"]) if ok(f) else None
        d = (bf - bq) if bq is not None and bf is not None else None
        gap[ctx] = {"flash_quad": bq, "flash": bf, "gap_bpb": d, "ppl_increase_pct": (2**d - 1) * 100 if d is not None else None}
    chunk = {}
    ref = run(REFERENCE, CHUNK_CONTEXT)
    for C in CHUNK_SIZES:
        rid = f"flash-{CHUNK_CONTEXT}" if C == 256 else f"flash-c{C}-{CHUNK_CONTEXT}"
        chunk[C] = row(summ.get(rid), ref)
    extrap = {}
    for rid, s in summ.items():
        if ok(s):
            L = s["context_len"]
            b = s["eval_bpb"]
            extrap[rid] = {"name": s["name"], "context_len": L, "bpb": {m: b.get(m * L) for m in (1, 2, 4)},
                           "skipped": {m: s["eval_skipped"].get(m * L) for m in (2, 4) if s["eval_skipped"].get(m * L)}}
    return {"main": main, "context": context, "gap": gap, "chunk": chunk, "extrapolation": extrap}


def verdicts(t: dict) -> list[dict]:
    """The paper's claims next to what was measured, each with a plain verdict."""
    out = []
    for ctx in CONTEXTS:
        f, r = t["context"]["flash"][ctx], t["context"][REFERENCE][ctx]
        if f.get("bpb") is None or r.get("bpb") is None:
            v, why = "not measured", "FLASH or Transformer++ run missing / not finished"
        else:
            d = f["bpb"] - r["bpb"]
            tol = MATCH_TOL * r["bpb"]
            v = "matches" if abs(d) <= tol else ("beats" if d < 0 else "falls short")
            why = f"FLASH {f['bpb']:.4f} vs Transformer++ {r['bpb']:.4f} bits/byte ({d:+.4f})"
        out.append({"claim": f"FLASH matches Transformer++'s quality (context {ctx})", "verdict": v, "measured": why})
    for ctx in CONTEXTS:
        f = t["context"]["flash"][ctx]
        if not f.get("ref_available") or f.get("status") in (None, "not in plan", "missing", "failed", "not-started"):
            v, why = "not measured", "FLASH or Transformer++ curve missing"
        elif f["speedup_time"] is None:
            v, why = "falls short", "FLASH's curve never reaches Transformer++'s final bits per byte"
        else:
            s = f["speedup_time"]
            v = "beats" if s > 4.9 else ("matches" if s >= 1.0 else "falls short")
            why = f"{s:.2f}x in training time ({f['speedup_steps']:.2f}x in steps)" if f["speedup_steps"] else f"{s:.2f}x"
        out.append({"claim": f"FLASH reaches Transformer++'s final quality 1.0-4.9x faster (Wiki-40B; context {ctx})",
                    "verdict": v, "measured": why})
    for ctx, g in t["gap"].items():
        if g["gap_bpb"] is None:
            v, why = "not measured", "FLASH or FLASH-Quad run missing"
        else:
            from lintime.evaluation.units import SEED_BYTES_PER_TOKEN, per_byte_change

            bound = 100 * per_byte_change(SEED_GAP_PER_TOKEN, SEED_BYTES_PER_TOKEN)
            v = "matches" if g["ppl_increase_pct"] <= bound else "falls short"
            if g["gap_bpb"] < 0:
                v = "beats"
            why = (f"gap {g['gap_bpb']:+.4f} bits/byte = {g['ppl_increase_pct']:+.2f} % per-byte perplexity "
                   f"(seed: <= {100 * SEED_GAP_PER_TOKEN:.1f} % per token = {bound:.2f} % per byte at "
                   f"{SEED_BYTES_PER_TOKEN:g} bytes/token)")
        out.append({"claim": f"FLASH-Quad -> FLASH costs little quality (Table 5; context {ctx})", "verdict": v,
                    "measured": why})
    ch = {C: r.get("bpb") for C, r in t["chunk"].items() if r.get("bpb") is not None}
    if len(ch) >= 2:
        best = min(ch, key=ch.get)
        v = "matches" if best >= 256 else "falls short"
        why = "; ".join(f"C={C}: {b:.4f}" for C, b in sorted(ch.items())) + f" (best C={best})"
    else:
        v, why = "not measured", "fewer than two chunk sizes finished"
    out.append({"claim": f"larger chunks (512 over 256) help beyond context 1024 (Figure 8; context {CHUNK_CONTEXT})",
                "verdict": v, "measured": why})
    return out


# ---------------------------------------------------------------------------------------------- plots


def plots(summ: dict[str, dict], assets: Path) -> list[str]:
    """PNG files (names relative to ``assets``); nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("quality_report: matplotlib not installed, no plots", file=sys.stderr)
        return []
    made = []
    several = len({s["session"] for s in summ.values()}) > 1

    def curves(ax, ids, key, label_of, tag=True):
        for rid in ids:
            s = summ.get(rid)
            if not usable(s):
                continue
            xs = [p[key] for p in s["curve"]]
            label = label_of(s) + ("" if ok(s) else f" ({s['status']})") + (f" [{s['session']}]" if several and tag else "")
            ax.plot(xs, [p["bpb"] for p in s["curve"]], marker=".", label=label)
        ax.set_ylabel("validation bits per byte")
        ax.grid(alpha=0.3)

    main_ids = [f"{m}-{MAIN_CONTEXT}" for m in MODELS]
    for key, xlabel, name in (("step", "step", "bpb_vs_steps"), ("time_s", "training time (s)", "bpb_vs_time")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        curves(ax, main_ids, key, lambda s: s["name"])
        ax.set_xlabel(xlabel)
        ax.set_title(f"context {MAIN_CONTEXT}, equal tokens")
        _clip_y(ax, [summ.get(r) for r in main_ids])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(assets / f"{name}_{MAIN_CONTEXT}.png", dpi=110)
        plt.close(fig)
        made.append(f"{name}_{MAIN_CONTEXT}.png")
    for key, xlabel, name in (("step", "step", "context_bpb_vs_steps"), ("time_s", "training time (s)", "context_bpb_vs_time")):
        fig, axes = plt.subplots(1, len(CONTEXTS), figsize=(4 * len(CONTEXTS), 4), sharey=True)
        for ax, ctx in zip(axes, CONTEXTS):
            ids = [f"{m}-{ctx}" for m in CONTEXT_MODELS]
            curves(ax, ids, key, lambda s: s["name"], tag=False)  # one legend for all panels: sessions in the title
            ref = summ.get(f"{REFERENCE}-{ctx}")
            other = [summ[r] for r in ids if usable(summ.get(r)) and ref is not None and summ[r]["session"] != ref["session"]]
            by = {}
            for o in other:
                by.setdefault(o["session"], []).append(o["name"])
            ax.set_title(f"context {ctx}" + "".join(f"\n{', '.join(v)}: session {k}" for k, v in sorted(by.items()))
                         + (f"; others {ref['session']}" if by else ""), fontsize=10)
            ax.set_xlabel(xlabel)
        _clip_y(axes[0], [s for s in summ.values() if s["model"] in CONTEXT_MODELS])
        if axes[0].get_legend_handles_labels()[0]:
            axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(assets / f"{name}.png", dpi=100)
        plt.close(fig)
        made.append(f"{name}.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ids = [f"flash-{CHUNK_CONTEXT}" if C == 256 else f"flash-c{C}-{CHUNK_CONTEXT}" for C in CHUNK_SIZES]
    curves(ax, ids + [f"{REFERENCE}-{CHUNK_CONTEXT}"], "time_s",
           lambda s: f"FLASH C={s['chunk_size'] or 256}" if s["model"] == "flash" else s["name"])
    ax.set_xlabel("training time (s)")
    ax.set_title(f"chunk size, context {CHUNK_CONTEXT}")
    _clip_y(ax, [summ.get(r) for r in ids])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(assets / "chunk_size.png", dpi=110)
    plt.close(fig)
    made.append("chunk_size.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in MODELS:
        s = summ.get(f"{m}-{MAIN_CONTEXT}")
        if ok(s):
            pts = [(k * MAIN_CONTEXT, s["eval_bpb"].get(k * MAIN_CONTEXT)) for k in (1, 2, 4)]
            pts = [(x, y) for x, y in pts if y is not None]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                    label=s["name"] + (f" [{s['session']}]" if several else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation context (trained at 1024)")
    ax.set_ylabel("bits per byte")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title("length extrapolation")
    fig.tight_layout()
    fig.savefig(assets / "extrapolation.png", dpi=110)
    plt.close(fig)
    made.append("extrapolation.png")
    return made


def _clip_y(ax, summs) -> None:
    """Leave out the first evaluations' high values so that the differences at the end show."""
    finals = [s["curve"][-1]["bpb"] for s in summs if usable(s)]
    firsts = [s["curve"][min(1, len(s["curve"]) - 1)]["bpb"] for s in summs if usable(s)]
    if finals and firsts:
        lo, hi = min(finals), max(firsts)
        if hi > lo:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))


# ---------------------------------------------------------------------------------------------- page


def fmt(x, spec=".4f", none="-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def fmt_speedup(r: dict) -> str:
    if r.get("status") in (None, "not in plan", "missing", "not-started", "failed"):
        return "-"
    if not r.get("ref_available"):
        return "no reference"
    if r.get("speedup_time") is None:
        return "not reached"
    return f"{r['speedup_time']:.2f}x ({fmt(r['speedup_steps'], '.2f')}x steps)"


CROSS = "†"


def cross(r: dict) -> bool:
    """The run and its Transformer++ reference ran in different sessions (timings not comparable)."""
    return bool(r.get("session") and r.get("ref_session") and r["session"] != r["ref_session"]
                and r.get("status") not in (None, "not in plan", "missing", "not-started", "failed"))


def xmark(r: dict) -> str:
    return f" {CROSS}" if cross(r) else ""


def cross_note(rows: list[dict], sess: list[dict]) -> list[str]:
    """The footnote under a table with cross-session cells (nothing when there are none)."""
    if not any(cross(r) for r in rows):
        return []
    pairs = sorted({(r["session"], r["ref_session"]) for r in rows if cross(r)})
    where = {x["label"]: x for x in sess}
    said = "; ".join(f"run in session {a} ({_short(where.get(a))}), its Transformer++ reference in session {b} "
                     f"({_short(where.get(b))})" for a, b in pairs)
    kinds = {frozenset(where[x]["environment"].get("devices") or []) for pair in pairs for x in pair if x in where}
    gpu = ("the GPU is the same kind but the host and the number of runs at a time may differ" if len(kinds) == 1
           else "the GPU kinds differ")
    return ["", f"{CROSS} {said}: training time and tokens/s are comparable within a session; across sessions {gpu}, "
            "so these times, tokens/s and speed-ups are approximate (bits per byte and speed-ups in steps are not "
            "affected)."]


def _short(s: dict | None) -> str:
    if s is None:
        return "?"
    devs = s["environment"].get("devices") or ["?"]
    return f"{len(devs)}x {sorted(set(devs))[0]}, {s['environment']['date_utc'][:16]} UTC"


def status_mark(r: dict) -> str:
    st = r.get("status", "missing")
    return "" if st == "ok" else f" **[{st}]**"


METHOD = """\
## What is measured

* **Corpus** (text nobody in this project wrote): the Linux kernel's `Documentation/` tree from
  Debian's `linux-doc` package plus the Python standard library's `.py` files, one document per file,
  byte-level (vocabulary 260: the 256 bytes and `<pad> <bos> <eos> <mask>`).
  `benchmarks/quality/prepare_data.py` builds it; the split is lintime's path-hash rule (5 %
  validation, 5 % test: `docs/data.md`), so it is fixed by the file paths and identical for every run.
  The test split is never looked at.
* **Models**: the `-medium` presets (d = 512, byte vocabulary, 25-29M parameters): FLASH and FLASH-Quad
  (16 GAU layers, s = 128, FLASH C = 256), Transformer++ / Transformer+ (8 blocks, 8 heads), GLA
  (8 blocks, 4 heads), Transformer-VQ (16 units, S = 512 codes, L = 256), the linear-attention GPT
  (8 GPT-2 blocks, learned positions up to 8192) and Performer (8 blocks, ReLU features, 128 per
  head); `lintime presets` lists them with their exact counts.
* **Training**: `lintime.training.train` (what `lintime train` runs), each family with its seed's
  recipe (`flash` for FLASH, FLASH-Quad, Transformer+/++, linear GPT and Performer; `gla` for GLA;
  `vq` for Transformer-VQ: `lintime/training/config.py`), equal tokens and equal context within
  every table, {tokens_desc}, packed documents (no attention across documents), seed 0, bf16
  autocast on the GPU.  One seed per run: differences of about 1 % are within run-to-run noise at
  this budget, which is far below the seed's (125K steps of 2^18 tokens).
* **Validation curves**: bits per byte every 1/16 of a run on the first 131,072 validation tokens
  (the same tokens every time).  **Final scores** (`lintime.evaluation.evaluate`): the first ~1M
  validation tokens (whole documents), at the training context and at 2x and 4x it.
* **Training time**: the trainer's time for the optimiser steps (no validation), with step 1 counted
  at the median step time (its excess is one-off start-up: CUDA context, Triton compiles).
* **Speed-up** (seed Table 3): Transformer++'s training time at the same context and tokens over the
  time at which a model's validation curve first reaches Transformer++'s final validation bits per
  byte (interpolated between evaluation points); "not reached" when it never does.
* **Verdicts** against the paper: "matches" when FLASH is within {tol:.0f} % of Transformer++'s bits per
  byte (or, for speed-ups, in or above the seed's range), "beats" / "falls short" otherwise.
"""


def regenerate_block(tokens: int) -> str:
    return f"""\
## Regenerate

```bash
# 1. data (here, with network): corpus + token cache + the archive the GPU machine gets (~12 MiB)
apt-get update && apt-get install -y linux-doc
python3 benchmarks/quality/prepare_data.py
# 2. the runs (one call on a 4-GPU machine; carry benchmarks/quality/data/quality_data.tar.xz)
OUT=quality_out TOKENS={tokens} DEADLINE_S=540 bash benchmarks/quality/gpu_quality.sh
#    (MODE=smoke-gpu first checks every configuration in a few steps per run; on a CPU:
#     python3 benchmarks/quality/quality_run.py all --out /tmp/q --mode smoke)
#    runs left out or failed: a later call with ONLY=id,id (OUT=quality_out2), then merged as a
#    second session (checks that corpus, tokens and plan entries agree; replaces failed records):
#    python3 benchmarks/quality/quality_merge.py --into quality_out --add quality_out2 --note "why it ran"
# 3. this page, the plots and quality.json from the results folder
python3 benchmarks/quality/quality_report.py --results quality_out
```

The plan (run ids, presets, contexts, budgets): `python3 benchmarks/quality/quality_plan.py`.
"""


def page(study: dict | None, summ: dict[str, dict] | None, t: dict | None, made: list[str], tokens: int) -> str:
    lines = ["# Results: quality on real text", ""]
    sess = sessions(study) if study is not None else []
    if study is None:
        lines += ["**Status: not yet run on a GPU.**  This page holds the method and the commands; the tables, "
                  "plots and `docs/results/quality.json` are generated from the GPU results by the last "
                  "command below.  No number on this page has been measured yet.", ""]
    elif len(sess) > 1:
        env = study["environment"]
        lines += [f"Measured in {len(sess)} sessions (the same corpus, plan and tokens per run; seed 0 for every run; "
                  f"mode `{env['mode']}`).  All numbers are in `docs/results/quality.json`.", ""]
        for x in sess:
            repl = ("; replaces the record(s) " + ", ".join(f"`{k}` ({v})" for k, v in x["replaced"].items())
                   if x["replaced"] else "")
            sup = "".join(f"; `{r['run']}` ({r['status']} here) ran again in session {r['by']}" for r in x["superseded"])
            lines.append(f"* **Session {x['label']}** ({len(x['runs'])} runs on this page{sup}): {describe_session(x)}"
                         + (f".  {x['note']}" if x.get("note") else "") + f"{repl}.")
        lines += ["", "Each run's session is in the Runs table.  Training time and tokens/s are comparable within a "
                  f"session; cells that compare runs of different sessions are marked {CROSS}.", ""]
        if env["mode"] != "full":
            lines += [f"**This is a `{env['mode']}` run: a pipeline check with a few steps per run.  Its numbers "
                      "say nothing about the models.**", ""]
    else:
        env = study["environment"]
        lines += [f"Measured {env['date_utc']} UTC on {', '.join(sorted(set(env['devices'])))} "
                  f"({len(env['slots'])} used, one run per device at a time); torch {env['torch']}, "
                  f"CUDA {env.get('cuda')}, Triton {env.get('triton')}, Python {env['python']}, lintime commit "
                  f"{(env.get('git_commit') or 'unknown')[:12]}; mode `{env['mode']}`; seed 0 for every run.  "
                  "All numbers are in `docs/results/quality.json`.", ""]
        if env["mode"] != "full":
            lines += [f"**This is a `{env['mode']}` run: a pipeline check with a few steps per run.  Its numbers "
                      "say nothing about the models.**", ""]
    tokens_desc = f"{tokens / 2**20:g} Mi tokens per run (2^15 tokens per step)"
    lines += [METHOD.format(tokens_desc=tokens_desc, tol=MATCH_TOL * 100), regenerate_block(tokens)]
    if study is None:
        lines += ["## Not yet run on a GPU", "",
                  "The study needs one call of a 4-GPU machine (~9 minutes).  Planned runs:", "",
                  "| run | preset | recipe | context | tokens | steps | tables |", "|---|---|---|---|---|---|---|"]
        for r in build_plan("full", tokens=tokens):
            lines.append(f"| `{r.id}` | `{r.preset}` | {r.recipe} | {r.context_len} | {r.tokens / 2**20:g} Mi | "
                         f"{r.steps} | {', '.join(r.tables)} |")
        lines.append("")
        return "\n".join(lines)
    assert summ is not None and t is not None
    multi = len(sess) > 1
    lines += ["## Runs", "", "| run | preset |" + (" session |" if multi else "") + " status | params | tokens | steps "
              "| training time (s) | start-up (s) | tokens/s | peak memory (GiB) |",
              "|---|---|" + ("---|" if multi else "") + "---|---|---|---|---|---|---|---|"]
    for s in summ.values():
        rebuilt = " (record rebuilt)" if s.get("reconstructed") else ""
        lines.append(f"| `{s['id']}` | `{s['preset']}` |" + (f" {s['session']} |" if multi else "")
                     + f" {s['status']}{rebuilt}{' (' + s['error'][:80] + ')' if s.get('error') else ''} "
                     f"| {fmt(s['n_params'] and s['n_params'] / 1e6, '.2f') + 'M' if s['n_params'] else '-'} | {s['tokens'] / 1e6:.2f}M | {s['steps']} "
                     f"| {fmt(s['train_s_adjusted'], '.1f')} | {fmt(s['startup_s'], '.1f')} | {fmt(s['tokens_per_s'], ',.0f')} "
                     f"| {fmt(s['peak_memory_gib'], '.1f')} |")
    if any(s.get("reconstructed") for s in summ.values()):
        lines += ["", "Record rebuilt: the run's result.json was rebuilt from its metrics.jsonl and the driver's summary "
                  "line (its own did not come back from the device); peak memory is unknown for those runs."]
    lines += ["", f"## Main table: context {MAIN_CONTEXT}", "",
              "| model | bits/byte (final eval) | last curve point | training time (s) | tokens/s | speed-up to Transformer++ |",
              "|---|---|---|---|---|---|"]
    for m, r in t["main"].items():
        lines.append(f"| {MODELS[m][0]}{status_mark(r)} | {fmt(r.get('bpb'))} | {fmt(r.get('final_val_bpb'))} "
                     f"| {fmt(r.get('train_s'), '.1f')}{xmark(r)} | {fmt(r.get('tokens_per_s'), ',.0f')}{xmark(r)} "
                     f"| {fmt_speedup(r)}{xmark(r)} |")
    lines += cross_note(list(t["main"].values()), sess)
    lines.append("")
    for name in made:
        if name.startswith("bpb_vs"):
            lines.append(f"![{name}](results/{name})")
    lines += ["", "## Context length (seed Table 3, Figures 5-6)", "",
              "| model | " + " | ".join(f"{c}: bits/byte" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
    for m in CONTEXT_MODELS:
        lines.append(f"| {MODELS[m][0]} | " + " | ".join(
            fmt(t["context"][m][c].get("bpb")) + status_mark(t["context"][m][c]) for c in CONTEXTS) + " |")
    lines += ["", "| model | " + " | ".join(f"{c}: time (s)" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
    for m in CONTEXT_MODELS:
        lines.append(f"| {MODELS[m][0]} | " + " | ".join(fmt(t["context"][m][c].get("train_s"), ".1f") + xmark(t["context"][m][c])
                                                         for c in CONTEXTS) + " |")
    lines += ["", "| model | " + " | ".join(f"{c}: speed-up" for c in CONTEXTS) + " |", "|---|" + "---|" * len(CONTEXTS)]
    for m in CONTEXT_MODELS:
        lines.append(f"| {MODELS[m][0]} | " + " | ".join(fmt_speedup(t["context"][m][c]) + xmark(t["context"][m][c])
                                                         for c in CONTEXTS) + " |")
    lines += cross_note([t["context"][m][c] for m in CONTEXT_MODELS for c in CONTEXTS], sess)
    lines.append("")
    for name in made:
        if name.startswith("context_"):
            lines.append(f"![{name}](results/{name})")
    lines += ["", "## FLASH-Quad -> FLASH (seed Table 5)", "",
              "Seed (LM, Wiki-40B, perplexity points): -0.05 / 0.06 / 0.22 / 0.30 / 0.11 at 512 / 1k / 2k / 4k / 8k.", "",
              "| context | FLASH-Quad | FLASH | gap (bits/byte) | per-byte perplexity increase |", "|---|---|---|---|---|"]
    for c, g in t["gap"].items():
        lines.append(f"| {c} | {fmt(g['flash_quad'])} | {fmt(g['flash'])} | {fmt(g['gap_bpb'], '+.4f')} "
                     f"| {fmt(g['ppl_increase_pct'], '+.2f')} % |")
    lines += ["", f"## Chunk size (seed Figure 8), context {CHUNK_CONTEXT}", "",
              "| C | bits/byte | training time (s) | tokens/s | speed-up to Transformer++ |", "|---|---|---|---|---|"]
    for C, r in t["chunk"].items():
        lines.append(f"| {C}{status_mark(r)} | {fmt(r.get('bpb'))} | {fmt(r.get('train_s'), '.1f')}{xmark(r)} "
                     f"| {fmt(r.get('tokens_per_s'), ',.0f')}{xmark(r)} | {fmt_speedup(r)}{xmark(r)} |")
    lines += cross_note(list(t["chunk"].values()), sess)
    if "chunk_size.png" in made:
        lines += ["", "![chunk_size.png](results/chunk_size.png)"]
    lines += ["", "## Length extrapolation (evaluated at 2x and 4x the training context)", "",
              "| run | trained at | bits/byte 1x | 2x | 4x | 4x minus 1x |", "|---|---|---|---|---|---|"]
    for rid, e in t["extrapolation"].items():
        b = e["bpb"]
        d = b[4] - b[1] if b.get(4) is not None and b.get(1) is not None else None
        skipped = "; ".join(f"{k}x: {v}" for k, v in e["skipped"].items())
        lines.append(f"| `{rid}` | {e['context_len']} | {fmt(b.get(1))} | {fmt(b.get(2), none='n/a')} "
                     f"| {fmt(b.get(4), none='n/a')} | {fmt(d, '+.4f')}{' (' + skipped + ')' if skipped else ''} |")
    if "extrapolation.png" in made:
        lines += ["", "![extrapolation.png](results/extrapolation.png)"]
    lines += ["", "## Against the paper's claims", "", "| claim (seed) | verdict | measured |", "|---|---|---|"]
    for v in verdicts(t):
        lines.append(f"| {v['claim']} | **{v['verdict']}** | {v['measured']} |")
    lines.append("")
    return "\n".join(lines)


NOTES_HEADING = "## Notes"


def hand_notes(doc: Path) -> str:
    """The hand-written part of an existing page: from its first line starting with ``## Notes`` to
    the end ("" when there is none); a regenerated page keeps it after the generated tables."""
    if not doc.exists():
        return ""
    lines = doc.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(NOTES_HEADING)), None)
    return "\n" + "".join(lines[start:]) if start is not None else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, help="the --out folder of quality_run.py all")
    ap.add_argument("--pending", action="store_true", help="write the page without results")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--assets", type=Path, default=None, help="plots and quality.json (default: <doc folder>/results)")
    ap.add_argument("--tokens", type=int, default=1 << 23, help="tokens per run (for --pending)")
    args = ap.parse_args(argv)
    if args.pending == (args.results is not None):
        ap.error("give --results DIR or --pending")
    assets = args.assets or args.doc.parent / "results"
    if args.pending:
        args.doc.write_text(page(None, None, None, [], args.tokens))
        print(f"quality_report: wrote {args.doc} (pending)")
        return 0
    study, runs = load_results(args.results)
    summ = summarise(runs, session_of(study))
    t = tables(summ)
    assets.mkdir(parents=True, exist_ok=True)
    made = plots(summ, assets)
    tokens = study["environment"].get("tokens_per_run", args.tokens)
    data = {"environment": study["environment"], "sessions": sessions(study), "plan": study["plan"], "runs": summ, "tables": t,
            "verdicts": verdicts(t), "plots": made}
    (assets / "quality.json").write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    notes = hand_notes(args.doc)
    args.doc.write_text(page(study, summ, t, made, tokens) + notes)
    print(f"quality_report: wrote {args.doc}, {assets / 'quality.json'} and {len(made)} plots"
          + (" (hand-written notes kept)" if notes else ""))
    return 0


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(type(x).__name__)


if __name__ == "__main__":
    sys.exit(main())
