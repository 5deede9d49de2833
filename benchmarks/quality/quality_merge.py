#!/usr/bin/env python3
"""Add the runs of a later quality-study call (another session: other machine, other date) to a
results folder, so that one ``quality_report.py --results <folder>`` makes the page from all of them.

A session is one call of ``quality_run.py all`` (``gpu_quality.sh``): its ``study.json`` holds the
machine's ``environment`` and the ``plan`` of the runs it ran.  Runs are per seed (``flash-1024-s1``),
so a later session may add seeds to a configuration as well as finish runs a first one left out.
Merging ``--add OTHER`` into ``--into FOLDER``:

* refuses (one line, exit 2) when the two sessions are not comparable: different corpus
  (``corpus.content_sha256``), tokens per run or mode, or a run id whose plan entry (preset, context,
  tokens, recipe, ...) differs between the two;
* copies ``runs/<id>/{config.json,metrics.jsonl,result.json}`` of every run of OTHER (or of
  ``--runs``) into FOLDER, replacing the record there when that run did not finish there (failed,
  killed, missing, time-capped); replacing a finished run needs ``--replace``;
* copies the added runs' logs (``logs/<id>.log``) and the session's ``study.log`` / ``gpu.txt`` /
  ``data.log`` to ``sessions/<date>/``;
* appends to ``study.json`` an ``extra_sessions`` entry ``{environment, runs, replaced, note}``
  (the GPU driver read from OTHER's ``gpu.txt`` when there) and adds the new runs to its ``plan`` in
  the full plan's order.  ``environment`` keeps describing the first session; a run counts for the
  last session that ran it (``quality_report.sessions``).

Usage::

    python3 benchmarks/quality/quality_merge.py --into benchmarks/results/quality_h200_2026-11-22 \\
        --add /tmp/q2 --note "7 missing runs on one H200"
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_plan import TABLES, build_plan  # noqa: E402

RUN_FILES = ("config.json", "metrics.jsonl", "result.json")
SESSION_FILES = ("study.log", "gpu.txt", "data.log")


class MergeError(Exception):
    """The two folders cannot be merged (the message is one line for the user)."""


def _study(folder: Path) -> dict:
    path = folder / "study.json"
    if not path.exists():
        raise MergeError(f"{path} not found (is {folder} the --out of quality_run.py all?)")
    return json.loads(path.read_text())


def _status(folder: Path, rid: str) -> str:
    path = folder / "runs" / rid / "result.json"
    return json.loads(path.read_text()).get("status", "missing") if path.exists() else "missing"


def _plan_key(entry: dict) -> str:
    """A plan entry as comparable text (``tables`` may be a list or a tuple)."""
    return json.dumps({k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in entry.items()}, sort_keys=True)


def gpu_driver(gpu_txt: Path) -> str | None:
    """The driver version from ``nvidia-smi --query-gpu=index,name,driver_version,...`` csv output."""
    if not gpu_txt.exists():
        return None
    lines = gpu_txt.read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if "driver_version" in line), None)
    if header is None:
        return None
    rows = list(csv.reader(lines[header:header + 2], skipinitialspace=True))
    if len(rows) < 2 or "driver_version" not in rows[0] or len(rows[1]) != len(rows[0]):
        return None
    return rows[1][rows[0].index("driver_version")].strip() or None


def merge(into: Path, add: Path, runs: list[str] | None = None, replace: bool = False, note: str | None = None) -> dict:
    """Merge session ``add`` into results folder ``into`` (see the module docstring); returns the
    new extra-session entry.  Nothing is written when a check fails."""
    base, other = _study(into), _study(add)
    env_a, env_b = base["environment"], other["environment"]
    for key, what in ((("corpus", "content_sha256"), "corpus"), (("tokens_per_run",), "tokens per run"),
                      (("mode",), "mode")):
        va, vb = env_a, env_b
        for k in key:
            va, vb = (va or {}).get(k), (vb or {}).get(k)
        if va != vb:
            raise MergeError(f"not comparable: {what} differs ({va!r} in {into}, {vb!r} in {add})")
    other_plan = {p["id"]: p for p in other["plan"]}
    wanted = runs if runs is not None else list(other_plan)
    unknown = [r for r in wanted if r not in other_plan]
    if unknown:
        raise MergeError(f"run(s) {unknown} are not in {add / 'study.json'}'s plan")
    base_plan = {p["id"]: p for p in base["plan"]}
    replaced = {}
    for rid in wanted:
        if rid in base_plan and _plan_key(base_plan[rid]) != _plan_key(other_plan[rid]):
            raise MergeError(f"run {rid}: its plan entry differs between the two folders (not the same run)")
        if not (add / "runs" / rid / "result.json").exists():
            raise MergeError(f"run {rid}: {add / 'runs' / rid / 'result.json'} not found")
        old = _status(into, rid)
        if old == "ok" and not replace:
            raise MergeError(f"run {rid} finished in {into} already (give --replace to take the new one)")
        if (into / "runs" / rid).exists():
            replaced[rid] = old
    # checks done: write
    for rid in wanted:
        dst = into / "runs" / rid
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for name in RUN_FILES:
            if (add / "runs" / rid / name).exists():
                shutil.copy2(add / "runs" / rid / name, dst / name)
    env = dict(env_b)
    driver = gpu_driver(add / "gpu.txt")
    if driver and "driver" not in env:
        env["driver"] = driver
    sess_dir = into / "sessions" / env["date_utc"].replace(" ", "_").replace(":", "")
    for rid in wanted:
        if (add / "logs" / f"{rid}.log").exists():
            (sess_dir / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copy2(add / "logs" / f"{rid}.log", sess_dir / "logs" / f"{rid}.log")
    for name in SESSION_FILES:
        if (add / name).exists():
            sess_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(add / name, sess_dir / name)
    entry = {"environment": env, "runs": list(wanted), "replaced": replaced,
             "files": str(sess_dir.relative_to(into)) if sess_dir.exists() else None, "note": note}
    base.setdefault("extra_sessions", []).append(entry)  # a run counts for the last session that ran it
    seeds = tuple(sorted(set(env_a.get("seeds") or [0]) | set(env_b.get("seeds") or [0])))
    tables = tuple(t for t in TABLES if t in set(env_a.get("tables") or TABLES) | set(env_b.get("tables") or TABLES))
    order = {r.id: i for i, r in enumerate(build_plan(env_a.get("mode", "full"), tokens=env_a["tokens_per_run"],
                                                      seeds=seeds, tables=tables))}
    merged = {**base_plan, **{rid: other_plan[rid] for rid in wanted}}
    base["plan"] = sorted(merged.values(), key=lambda p: (order.get(p["id"], len(order)), p["id"]))
    (into / "study.json").write_text(json.dumps(base, indent=1) + "\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--into", type=Path, required=True, help="the results folder to add to (its study.json is rewritten)")
    ap.add_argument("--add", type=Path, required=True, help="the --out folder of the later session")
    ap.add_argument("--runs", default=None, help="comma-separated run ids to take (default: all of --add)")
    ap.add_argument("--replace", action="store_true", help="also replace runs that finished in --into")
    ap.add_argument("--note", default=None, help="a line on the session (why it ran, what differed)")
    args = ap.parse_args(argv)
    try:
        entry = merge(args.into, args.add, args.runs.split(",") if args.runs else None, args.replace, args.note)
    except MergeError as e:
        print(f"quality_merge: {e}", file=sys.stderr)
        return 2
    rep = "; replaced " + ", ".join(f"{k} ({v})" for k, v in entry["replaced"].items()) if entry["replaced"] else ""
    print(f"quality_merge: added {len(entry['runs'])} runs of {entry['environment']['date_utc']} UTC to "
          f"{args.into}{rep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
