"""The quality study's numbers: per-run summaries, seeds aggregated into mean ± spread, the tables,
the equal-wall-time view and the verdicts against the seed's claims (``quality_report.py`` prints
them, ``quality_plots.py`` draws them).

Definitions (also stated on the page):

* **spread**: the sample standard deviation over a configuration's finished seeds (``n - 1``:
  :func:`lintime.evaluation.units.mean_spread`); a table cell is ``mean ± spread``;
* **difference beyond the spread**: two configurations differ when ``|mean_a - mean_b| > spread_a +
  spread_b`` (:func:`lintime.evaluation.units.differs`); with fewer than two seeds on either side
  there is no verdict;
* **training time**: the trainer's ``time_s`` (optimiser steps only, no validation), with step 1
  and every step slower than 3 median steps counted at the median step time (their excess is
  one-off work: CUDA context, Triton compiles and autotuning: :func:`one_off`);
* **speed-up** (seed Table 3): ``T_ref / t_reach`` per seed, ``T_ref`` the reference's (Transformer++
  at the same context and tokens) mean training time, ``t_reach`` the time at which the seed's
  validation curve first reaches the reference's mean final validation bits per byte (linear
  interpolation between evaluation points); the same with steps;
* **equal wall time**: each seed's validation bits per byte at a given training time (interpolated
  on its curve; a run that ended earlier counts with its final value, marked), at fractions of
  ``T_ref``;
* **FLASH-Quad -> FLASH gap** (seed Table 5): FLASH's mean bits per byte minus FLASH-Quad's; the
  per-byte perplexity change ``2**gap - 1`` and, at the seed's bytes per token, the per-token one.

Verdicts: a claim is a band around a difference ``d ± S`` (``S``: the combined spread), and the
verdict says on which side of the claim's bound the whole interval lies; when it straddles the
bound, or a side has fewer than two seeds, the verdict is "no verdict".
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

from quality_plan import (  # noqa: E402
    CHUNK_CONTEXT,
    CHUNK_SIZES,
    CONTEXT_MODELS,
    CONTEXTS,
    MAIN_CONTEXT,
    MODELS,
    REFERENCE,
)

from lintime.evaluation.units import SEED_BYTES_PER_TOKEN, mean_spread, per_byte_change, per_token_change  # noqa: E402

# "FLASH matches Transformer++": the seed gives no band; within 1 % of the reference's bits per byte
MATCH_TOL = 0.01
# seed Table 5 (LM, Wiki-40B): +0.06 to +0.30 perplexity points on ~20-25, i.e. <= ~1.5 % *per token*
SEED_GAP_PER_TOKEN = 0.015
# seed Table 3: FLASH reaches Transformer++'s final quality 1.0-4.9x faster (in training time)
SEED_SPEEDUP = (1.0, 4.9)
EQUAL_TIME_FRACTIONS = (0.25, 0.5, 1.0)  # of the reference's mean training time
NO_VERDICT = "no verdict"


# ---------------------------------------------------------------------------------------------- one run


SLOW_STEP = 3.0  # a step slower than this many median steps did one-off work (a compile, autotuning)


def one_off(metrics: list[dict]) -> dict[int, float]:
    """``{step: one-off seconds up to and including it}``: step 1's time and that of every step
    slower than ``SLOW_STEP`` median steps, beyond the median step time (one-off work: CUDA context,
    Triton compiles and autotuning, paid by whichever run of a family first ran on a machine)."""
    times = [(r["step"], r["time_s"]) for r in metrics if "time_s" in r and "loss" in r]
    if len(times) < 3 or times[0][0] != 1:
        return {}
    dts = [(b[0], b[1] - a[1]) for a, b in zip(times, times[1:]) if b[0] == a[0] + 1]
    if not dts:
        return {}
    med = statistics.median(d for _, d in dts)
    out, total = {1: max(times[0][1] - med, 0.0)}, max(times[0][1] - med, 0.0)
    for step, d in dts:
        if d > SLOW_STEP * med:
            total += d - med
        out[step] = total
    return out


def startup_offset(metrics: list[dict]) -> float:
    """All one-off seconds of a run (:func:`one_off`'s total; 0 without per-step rows)."""
    off = one_off(metrics)
    return max(off.values()) if off else 0.0


def val_curve(metrics: list[dict]) -> list[dict]:
    """Evaluation points ``{step, tokens, time_s (one-off time up to that step removed), bpb}`` in
    step order."""
    off = one_off(metrics)
    steps = sorted(off)

    def removed(step: int) -> float:  # the one-off time of the last step logged at or before ``step``
        i = bisect.bisect_right(steps, step) - 1
        return off[steps[i]] if i >= 0 else 0.0

    pts = [{"step": r["step"], "tokens": r["tokens"], "time_s": max(r["time_s"] - removed(r["step"]), 0.0),
            "bpb": r["val_bpb"]} for r in metrics if r.get("val_bpb") is not None]
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


def bpb_at(curve: list[dict], x: float, key: str = "time_s") -> tuple[float | None, str]:
    """The curve's bits per byte at ``key == x``: ``(value, "")`` interpolated between evaluation
    points, ``(final value, "ended")`` when the run ended before ``x``, ``(None, "before")`` when
    ``x`` precedes its first evaluation."""
    if not curve:
        return None, "before"
    if x < curve[0][key]:
        return None, "before"
    if x >= curve[-1][key]:
        return curve[-1]["bpb"], ("" if x == curve[-1][key] else "ended")
    for a, b in zip(curve, curve[1:]):
        if a[key] <= x <= b[key]:
            f = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a["bpb"] + f * (b["bpb"] - a["bpb"]), ""
    return None, "before"  # unreachable for a sorted curve


_SEED_SUFFIX = re.compile(r"-s(\d+)$")


def group_of(spec: dict) -> tuple[str, int]:
    """``(group, seed)`` of a plan entry; entries written before seeds existed (id ``flash-1024``,
    no ``group``) are their own group, seed ``spec["seed"]`` (0)."""
    if spec.get("group"):
        return spec["group"], int(spec.get("seed", 0))
    m = _SEED_SUFFIX.search(spec["id"])
    if m and "seed" in spec:
        return spec["id"][:m.start()], int(m.group(1))
    return spec["id"], int(spec.get("seed", 0))


def summarise(runs: dict[str, dict], session: dict[str, str] | None = None) -> dict[str, dict]:
    """Per run: the numbers every table reads (``session``: run id -> session label, default A)."""
    out = {}
    for rid, rec in runs.items():
        spec, tr = rec["run"], rec.get("train") or {}
        curve = val_curve(rec["metrics"])
        evals = {r["context_len"]: r for r in (rec.get("eval") or {}).get("results", [])}
        cum = one_off(rec["metrics"])
        off = max(cum.values()) if cum else 0.0
        train_s = tr.get("elapsed_s")
        group, seed = group_of(spec)
        out[rid] = {
            "id": rid, "group": group, "seed": seed, "init_seed": spec.get("init_seed"),
            "model": spec["model"], "name": MODELS[spec["model"]][0], "preset": spec["preset"],
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
            "loss": [[r["step"], r["time_s"] - cum.get(r["step"], 0.0), r["loss"]] for r in rec["metrics"] if "loss" in r],
        }
    return out


def ok(s: dict | None) -> bool:
    return s is not None and s["status"] == "ok"


# ---------------------------------------------------------------------------------------------- seeds


def stat(values) -> dict:
    """``{mean, spread, n, min, max, values}`` of the finite values (spread: sample std; 0 for one
    value, which the page prints as "1 seed", never as a spread)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    m, s, n = mean_spread(xs)
    return {"mean": m if n else None, "spread": s if n else None, "n": n, "min": min(xs) if xs else None,
            "max": max(xs) if xs else None, "values": xs}


def diff(a: dict, b: dict) -> dict:
    """``a - b`` of two stats: ``{mean, spread (spread_a + spread_b), n (the smaller n), beyond}``;
    ``beyond`` (the difference exceeds the combined spread) is None unless both have two seeds."""
    if not a["n"] or not b["n"]:
        return {"mean": None, "spread": None, "n": 0, "beyond": None}
    d, S, n = a["mean"] - b["mean"], a["spread"] + b["spread"], min(a["n"], b["n"])
    return {"mean": d, "spread": S, "n": n, "beyond": (abs(d) > S) if n >= 2 else None}


def groups(summ: dict[str, dict]) -> dict[str, list[dict]]:
    """``{group: [run summaries in seed order]}`` in the plan's order of first appearance."""
    out: dict[str, list[dict]] = {}
    for s in summ.values():
        out.setdefault(s["group"], []).append(s)
    return {g: sorted(v, key=lambda s: s["seed"]) for g, v in out.items()}


def group_status(runs: list[dict]) -> str:
    """``ok`` when every seed finished, else e.g. ``2/3 ok (1 killed)``."""
    bad = [s["status"] for s in runs if not ok(s)]
    if not bad:
        return "ok"
    counts = {st: bad.count(st) for st in dict.fromkeys(bad)}
    return f"{len(runs) - len(bad)}/{len(runs)} ok (" + ", ".join(f"{c} {st}" for st, c in counts.items()) + ")"


def at_time(runs: list[dict], t: float) -> dict:
    """The finished seeds' bits per byte at training time ``t``: a stat, plus ``ended`` (seeds whose
    run ended before ``t``: their final value) and ``before`` (seeds with no evaluation by ``t``)."""
    vals, ended, before = [], 0, 0
    for s in runs:
        if not ok(s):
            continue
        v, why = bpb_at(s["curve"], t)
        if v is None:
            before += 1
            continue
        vals.append(v)
        ended += why == "ended"
    return stat(vals) | {"ended": ended, "before": before, "t": t}


def row(g: list[dict] | None, ref: list[dict] | None) -> dict:
    """A configuration's table row: its seeds aggregated, and its speed-ups to ``ref``'s."""
    if not g:
        return {"status": "not in plan", "n": 0}
    fin = [s for s in g if ok(s)]
    ref_fin = [s for s in (ref or []) if ok(s) and s["curve"]]
    out = {
        "group": g[0]["group"], "runs": [s["id"] for s in g], "seeds": [s["seed"] for s in g], "n": len(g),
        "n_ok": len(fin), "status": group_status(g),
        "bpb": stat(s["eval_bpb"].get(s["context_len"]) for s in fin),
        "final_val_bpb": stat(s["final_val_bpb"] for s in fin),
        "train_s": stat(s["train_s_adjusted"] for s in fin), "tokens_per_s": stat(s["tokens_per_s"] for s in fin),
        "tokens": g[0]["planned_tokens"], "steps": max((s["steps"] for s in g), default=0),
        "n_params": next((s["n_params"] for s in g if s["n_params"]), None),
        "sessions": sorted({s["session"] for s in fin}), "ref_sessions": sorted({s["session"] for s in ref_fin}),
        "ref_available": bool(ref_fin), "speedup_time": stat([]), "speedup_steps": stat([]), "reached": 0,
    }
    if ref_fin and fin:
        target = statistics.fmean(s["curve"][-1]["bpb"] for s in ref_fin)
        t_ref = statistics.fmean(s["curve"][-1]["time_s"] for s in ref_fin)
        step_ref = statistics.fmean(s["curve"][-1]["step"] for s in ref_fin)
        sp_t, sp_s = [], []
        for s in fin:
            t, st = first_reach(s["curve"], target, "time_s"), first_reach(s["curve"], target, "step")
            if t and st:
                sp_t.append(t_ref / t)
                sp_s.append(step_ref / st)
        out.update(speedup_time=stat(sp_t), speedup_steps=stat(sp_s), reached=len(sp_t), target_bpb=target,
                   ref_time_s=t_ref)
    return out


def tables(summ: dict[str, dict]) -> dict:
    """All tables as data (what quality.json stores and the page prints); a table none of whose
    configurations is in the study is left out."""
    gs = groups(summ)

    def grp(model: str, ctx: int, chunk: int | None = None) -> list[dict] | None:
        return gs.get(f"{model}-{ctx}" if chunk in (None, 256) else f"{model}-c{chunk}-{ctx}")

    t: dict = {"n_seeds": max((len(v) for v in gs.values()), default=0)}
    t["main"] = {m: row(grp(m, MAIN_CONTEXT), grp(REFERENCE, MAIN_CONTEXT)) for m in MODELS}
    t["main_vs_ref"] = {m: diff(r["bpb"], t["main"][REFERENCE]["bpb"]) if r.get("n") and t["main"][REFERENCE].get("n")
                        else diff(stat([]), stat([])) for m, r in t["main"].items()}
    t["equal_time"] = equal_time(gs, MAIN_CONTEXT)
    others = [c for c in CONTEXTS if c != MAIN_CONTEXT]
    if any(grp(m, c) for m in CONTEXT_MODELS for c in others):
        t["context"] = {m: {c: row(grp(m, c), grp(REFERENCE, c)) for c in CONTEXTS} for m in CONTEXT_MODELS}
    t["gap"] = {}
    for c in CONTEXTS:
        q, f = grp("flash-quad", c), grp("flash", c)
        if not q or not f:
            continue
        bq, bf = (stat(s["eval_bpb"].get(s["context_len"]) for s in g if ok(s)) for g in (q, f))
        d = diff(bf, bq)
        pct = None if d["mean"] is None else 100 * (2 ** d["mean"] - 1)
        t["gap"][c] = {"flash_quad": bq, "flash": bf, "gap_bpb": d, "ppl_increase_pct": pct,
                       "ppl_increase_pct_range": None if d["mean"] is None else
                       [100 * (2 ** (d["mean"] - d["spread"]) - 1), 100 * (2 ** (d["mean"] + d["spread"]) - 1)],
                       "per_token_pct": None if pct is None else 100 * per_token_change(pct / 100)}
    if any(grp("flash", CHUNK_CONTEXT, C) for C in CHUNK_SIZES if C != 256):
        t["chunk"] = {C: row(grp("flash", CHUNK_CONTEXT, C), grp(REFERENCE, CHUNK_CONTEXT)) for C in CHUNK_SIZES}
    extrap = {}
    order = list(MODELS)
    for gid, g in sorted(gs.items(), key=lambda kv: (order.index(kv[1][0]["model"]), kv[1][0]["context_len"],
                                                     kv[1][0]["chunk_size"] or 0)):
        fin = [s for s in g if ok(s)]
        if not fin:
            continue
        L = fin[0]["context_len"]

        def at(s, m):
            return s["eval_bpb"].get(m * L)

        extrap[gid] = {"name": fin[0]["name"], "context_len": L, "n": len(fin),
                       "bpb": {m: stat(at(s, m) for s in fin) for m in (1, 2, 4)},
                       "delta_4x": stat(at(s, 4) - at(s, 1) for s in fin if at(s, 4) is not None and at(s, 1) is not None),
                       "skipped": sorted({f"{m}x: {s['eval_skipped'][m * L]}" for s in fin for m in (2, 4)
                                          if s["eval_skipped"].get(m * L)})}
    t["extrapolation"] = extrap
    return t


def equal_time(gs: dict[str, list[dict]], ctx: int) -> dict:
    """Bits per byte of every model at context ``ctx`` at fractions of the reference's mean
    training time (``{t_ref, times, rows: {model: {fraction: at_time}}}``; empty without a finished
    reference)."""
    ref = [s for s in gs.get(f"{REFERENCE}-{ctx}", []) if ok(s) and s["curve"]]
    if not ref:
        return {}
    t_ref = statistics.fmean(s["curve"][-1]["time_s"] for s in ref)
    rows = {}
    for m in MODELS:
        g = gs.get(f"{m}-{ctx}")
        if g:
            rows[m] = {f: at_time(g, f * t_ref) for f in EQUAL_TIME_FRACTIONS}
    return {"context": ctx, "t_ref": t_ref, "fractions": list(EQUAL_TIME_FRACTIONS), "rows": rows,
            "ref_final": stat(s["curve"][-1]["bpb"] for s in ref)}


# ---------------------------------------------------------------------------------------------- verdicts


def judge_match(d: dict, tol: float) -> tuple[str, str]:
    """Claim "the two match" with band ``±tol``: matches when ``|d| + S <= tol``, beats / falls short
    when ``d + S < -tol`` / ``d - S > tol`` (lower is better), else no verdict."""
    if d["n"] < 2:
        return NO_VERDICT, "fewer than two seeds"
    m, S = d["mean"], d["spread"]
    if abs(m) + S <= tol:
        return "matches", f"|d| + spread <= {tol:.4f}"
    if m - S > tol:
        return "falls short", f"d - spread > {tol:.4f}"
    if m + S < -tol:
        return "beats", f"d + spread < -{tol:.4f}"
    return NO_VERDICT, f"d ± spread straddles the ±{tol:.4f} band"


def judge_bound(d: dict, bound: float) -> tuple[str, str]:
    """Claim "d <= bound" (a cost): beats when even ``d + S < 0``, matches when ``d + S <= bound``,
    falls short when ``d - S > bound``, else no verdict."""
    if d["n"] < 2:
        return NO_VERDICT, "fewer than two seeds"
    m, S = d["mean"], d["spread"]
    if m + S < 0:
        return "beats", "d + spread < 0"
    if m + S <= bound:
        return "matches", f"d + spread <= {bound:.4f}"
    if m - S > bound:
        return "falls short", f"d - spread > {bound:.4f}"
    return NO_VERDICT, f"d ± spread straddles {bound:.4f}"


def judge_speedup(gs: dict[str, list[dict]], ctx: int) -> tuple[str, str]:
    """Seed Table 3 (FLASH reaches Transformer++'s final quality 1.0-4.9x faster) as an equal-time
    comparison: FLASH's bits per byte at ``T_ref / k`` against Transformer++'s final one, ``k`` = 1.0
    and 4.9; reached beyond the spread at ``T_ref`` -> matches (beats when also at ``T_ref / 4.9``);
    not reached beyond the spread at ``T_ref`` -> falls short (unless FLASH's runs ended earlier)."""
    ref = [s for s in gs.get(f"{REFERENCE}-{ctx}", []) if ok(s) and s["curve"]]
    fl = gs.get(f"flash-{ctx}") or []
    if len(ref) < 2 or sum(ok(s) for s in fl) < 2:
        return NO_VERDICT, "fewer than two seeds of FLASH or Transformer++"
    t_ref = statistics.fmean(s["curve"][-1]["time_s"] for s in ref)
    target = stat(s["curve"][-1]["bpb"] for s in ref)
    lo, hi = SEED_SPEEDUP
    at1 = at_time(fl, t_ref / lo)
    if at1["n"] < 2:
        return NO_VERDICT, "FLASH has fewer than two seeds evaluated by Transformer++'s time"
    d1 = diff(at1, target)
    said = (f"validation curves: FLASH at Transformer++'s mean training time ({t_ref:.1f} s) {fmt_stat(at1)} vs "
            f"Transformer++'s final {fmt_stat(target)} bits/byte (d = {fmt_diff(d1)})")
    if d1["mean"] - d1["spread"] > 0:
        if at1["ended"]:
            return NO_VERDICT, said + f"; {at1['ended']} FLASH seed(s) ended earlier: more tokens might reach it"
        return "falls short", said + ": not reached in Transformer++'s time, beyond the spread"
    if d1["mean"] + d1["spread"] >= 0:
        return NO_VERDICT, said + ": within the spread"
    at_hi = at_time(fl, t_ref / hi)
    d_hi = diff(at_hi, target)
    if d_hi["n"] >= 2 and d_hi["mean"] + d_hi["spread"] < 0:
        return "beats", said + f"; reached by T/{hi:g} too"
    return "matches", said + ": reached before Transformer++'s time, beyond the spread"


def verdicts(t: dict, summ: dict[str, dict]) -> list[dict]:
    """The seed's claims that this study's configurations can test, each with a verdict, the
    numbers and the rule that decided it."""
    gs = groups(summ)
    out = []
    ctxs = [c for c in CONTEXTS if c == MAIN_CONTEXT or "context" in t]
    ctxs = [c for c in ctxs if gs.get(f"flash-{c}") and gs.get(f"{REFERENCE}-{c}")]  # both in the study
    for c in ctxs:
        f = t["main"]["flash"] if c == MAIN_CONTEXT else t["context"]["flash"][c]
        r = t["main"][REFERENCE] if c == MAIN_CONTEXT else t["context"][REFERENCE][c]
        if not f.get("n_ok") or not r.get("n_ok"):
            v, why = NO_VERDICT, "FLASH or Transformer++ not finished"
        else:
            d = diff(f["bpb"], r["bpb"])
            tol = MATCH_TOL * r["bpb"]["mean"]
            v, rule = judge_match(d, tol)
            why = (f"FLASH {fmt_stat(f['bpb'])} vs Transformer++ {fmt_stat(r['bpb'])} bits/byte: d = "
                   f"{fmt_diff(d)}; band ±{tol:.4f} (1 %): {rule}")
        out.append({"claim": f"FLASH matches Transformer++'s quality (context {c})", "verdict": v, "measured": why})
    for c in ctxs:
        v, why = judge_speedup(gs, c)
        out.append({"claim": f"FLASH reaches Transformer++'s final quality 1.0-4.9x faster in training time "
                             f"(Table 3; context {c})", "verdict": v, "measured": why})
    bound_pct = 100 * per_byte_change(SEED_GAP_PER_TOKEN, SEED_BYTES_PER_TOKEN)
    bound_bpb = math.log2(1 + bound_pct / 100)
    for c, g in t["gap"].items():
        d = g["gap_bpb"]
        if d["mean"] is None:
            v, why = NO_VERDICT, "FLASH or FLASH-Quad not finished"
        else:
            v, rule = judge_bound(d, bound_bpb)
            lo, hi = g["ppl_increase_pct_range"]
            rng = f" ({lo:+.2f} to {hi:+.2f} % at ± spread)" if d["n"] >= 2 else ""
            why = (f"gap {fmt_diff(d)} bits/byte = {g['ppl_increase_pct']:+.2f} % per-byte perplexity{rng}, "
                   f"{g['per_token_pct']:+.2f} % per token at {SEED_BYTES_PER_TOKEN:g} "
                   f"bytes/token; seed: <= {100 * SEED_GAP_PER_TOKEN:.1f} % per token = {bound_pct:.2f} % per byte "
                   f"= {bound_bpb:.4f} bits/byte: {rule}")
        out.append({"claim": f"FLASH-Quad -> FLASH costs little quality (Table 5; context {c})", "verdict": v,
                    "measured": why})
    if "chunk" in t:
        a, b = t["chunk"][512], t["chunk"][256]
        if not a.get("n_ok") or not b.get("n_ok"):
            v, why = NO_VERDICT, "C = 512 or C = 256 not finished"
        else:
            d = diff(a["bpb"], b["bpb"])
            v = (NO_VERDICT if d["n"] < 2 else "matches" if d["mean"] + d["spread"] < 0
                 else "falls short" if d["mean"] - d["spread"] > 0 else NO_VERDICT)
            why = f"C=512 {fmt_stat(a['bpb'])} vs C=256 {fmt_stat(b['bpb'])} bits/byte: d = {fmt_diff(d)}"
            why += "" if v != NO_VERDICT else (": fewer than two seeds" if d["n"] < 2 else ": within the spread")
        out.append({"claim": f"larger chunks (512 over 256) help beyond context 1024 (Figure 8; context {CHUNK_CONTEXT})",
                    "verdict": v, "measured": why})
    return out


# ---------------------------------------------------------------------------------------------- text


def fmt(x, spec=".4f", none="-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def fmt_stat(s: dict | None, spec: str = ".4f", of: int | None = None) -> str:
    """``mean ± spread`` (``(n=2)`` appended when fewer than ``of`` seeds), ``mean (1 seed)``, ``-``."""
    if not s or not s.get("n"):
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:{spec}} (1 seed)"
    return f"{s['mean']:{spec}} ± {s['spread']:{spec}}" + (f" (n={s['n']})" if of and s["n"] < of else "")


def fmt_diff(d: dict, spec: str = "+.4f") -> str:
    if d.get("mean") is None:
        return "-"
    if d["n"] < 2:
        return f"{d['mean']:{spec}} (1 seed: no spread)"
    return f"{d['mean']:{spec}} ± {d['spread']:{spec[1:]}}"
