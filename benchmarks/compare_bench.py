"""Compare two ``lintime bench model`` results row by row: what changed since the previous committed run.

    python3 benchmarks/compare_bench.py OLD.json NEW.json [--threshold 0.05] [--part train|decode] [--new-only]
        [--markdown]
    python3 benchmarks/compare_bench.py <(git show HEAD:docs/results/bench_model.json) docs/results/bench_model.json

A file is a ``bench_model.json`` (its ``train`` and ``decode`` rows; a ``--from-json`` merge too) or any JSON that
holds bench-model rows under ``bench_model_rows`` (``docs/results/train_default.json``).  Rows are matched on
``(part, preset, T)`` for training and ``(part, preset, L, batch, path)`` for decoding: a ``<preset>@eager`` or
``@graph`` row is another row than the plain preset's.  Each matched row prints both tokens/s (decoding: generated
tokens/s, ``batch / token_ms``) and ``new / old``; a row of NEW with no counterpart is a ``new row``, a row of OLD
that NEW lacks is ``not re-run`` (``--new-only`` leaves those out; ``--part`` keeps one part), a row that is not
``ok`` on either side is shown with its status and not compared.
A row whose ratio is below ``1 - threshold`` (default 5 %) is named at the end as a regression, and the exit
status is then 1 (0 otherwise), so a script or CI step can stop on it.  Each side's date, commit and device are
printed first: a ratio across machines or settings is a hint, a ratio within one session a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    """``{"env", "settings", "rows": {key: row}}`` of a bench-model result; keys as in the module's docstring."""
    data = json.loads(Path(path).read_text())
    train = data.get("train")
    if train is None:  # e.g. train_default.json: bench-model rows beside other results
        train = [r for r in data.get("bench_model_rows", []) if "T" in r]
    env = data.get("env") or data.get("bench_model_env") or {}
    rows: dict[tuple, dict] = {}
    for r in train:
        rows.setdefault(("train", r["preset"], r["T"]), r)  # a preset timed twice: the first row counts
    for r in data.get("decode", []):
        rows.setdefault(("decode", r["preset"], r["L"], r.get("batch", 1), r.get("path") or "eager"), r)
    return {"env": env, "settings": data.get("settings", {}), "rows": rows}


def label(key: tuple) -> str:
    if key[0] == "train":
        return f"train  {key[1]} T={key[2]}"
    return f"decode {key[1]} L={key[2]} B={key[3]} {key[4]}"


def compare(old: dict, new: dict, threshold: float = 0.05, part: str | None = None,
            new_only: bool = False) -> list[dict]:
    """One entry per row of NEW (in its order), then OLD's rows that NEW lacks: ``key``, ``old`` / ``new``
    tokens/s (``None`` where absent or not ok), ``ratio`` (new / old, or ``None``), ``verdict``: ``same``,
    ``faster``, ``REGRESSION`` (ratio below ``1 - threshold``), ``new row``, ``not re-run`` or ``not ok: ...``.
    ``part`` (``train`` / ``decode``) keeps that part's rows only; ``new_only`` leaves out OLD's rows that NEW lacks."""
    out = []

    def tps(r):
        return r.get("tokens_per_s") if r is not None and r.get("status") == "ok" else None

    for key, r in new["rows"].items():
        o = old["rows"].get(key)
        a, b = tps(o), tps(r)
        if o is None:
            verdict, ratio = "new row", None
        elif a is None or b is None:
            bad = r if b is None else o
            verdict, ratio = f"not ok: {bad.get('status')} ({'new' if b is None else 'old'})", None
        else:
            ratio = b / a
            verdict = "REGRESSION" if ratio < 1 - threshold else "faster" if ratio > 1 + threshold else "same"
        out.append({"key": key, "old": a, "new": b, "ratio": ratio, "verdict": verdict})
    if not new_only:
        for key, o in old["rows"].items():
            if key not in new["rows"]:
                out.append({"key": key, "old": tps(o), "new": None, "ratio": None, "verdict": "not re-run"})
    return [e for e in out if part is None or e["key"][0] == part]


def _k(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _side(name: str, res: dict) -> str:
    env = res["env"]
    return (f"{name}: {env.get('date', '?')}, commit {env.get('git_commit') or '?'}, {env.get('device', '?')}, "
            f"{res['settings'].get('dtype', '?')}, {res['settings'].get('tokens_per_batch', '?')} tokens per step")


def report(entries: list[dict], old: dict, new: dict, threshold: float, markdown: bool = False) -> str:
    lines = [_side("old", old), _side("new", new), ""]
    if markdown:
        lines += ["| row | old tokens/s | new tokens/s | new / old | |", "|---|---|---|---|---|"]
        for e in entries:
            ratio = f"{e['ratio']:.3f}" if e["ratio"] is not None else "-"
            lines.append(f"| {label(e['key'])} | {_k(e['old'])} | {_k(e['new'])} | {ratio} | {e['verdict']} |")
    else:
        lines.append(f"{'row':<52} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}  verdict")
        for e in entries:
            ratio = f"{e['ratio']:.3f}" if e["ratio"] is not None else "-"
            lines.append(f"{label(e['key']):<52} {_k(e['old']):>10} {_k(e['new']):>10} {ratio:>8}  {e['verdict']}")
    slower = [e for e in entries if e["verdict"] == "REGRESSION"]
    lines.append("")
    if slower:
        lines.append(f"slower than the old run by more than {threshold:.0%}: "
                     + ", ".join(f"{label(e['key']).split(None, 1)[1]} ({e['ratio']:.3f})" for e in slower))
    else:
        lines.append(f"no row slower than the old run by more than {threshold:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", help="the previous result (bench_model.json, or a JSON with bench_model_rows)")
    p.add_argument("new", help="the new result")
    p.add_argument("--threshold", type=float, default=0.05, help="a row slower by more than this is a regression")
    p.add_argument("--part", choices=("train", "decode"), help="compare this part's rows only")
    p.add_argument("--new-only", action="store_true", help="leave out the old rows that the new run did not time")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    old, new = load(args.old), load(args.new)
    entries = compare(old, new, args.threshold, args.part, args.new_only)
    print(report(entries, old, new, args.threshold, args.markdown))
    return 1 if any(e["verdict"] == "REGRESSION" for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
