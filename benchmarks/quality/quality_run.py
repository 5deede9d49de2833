#!/usr/bin/env python3
"""Run the quality study's plan (``quality_plan.py``) on the visible GPUs, or on the CPU.

``all``: one worker slot per GPU (``CUDA_VISIBLE_DEVICES`` = that GPU; the GPUs are those the
parent's ``CUDA_VISIBLE_DEVICES`` lists, or all), each taking the next run of the plan when it is free
(list scheduling in the plan's order: main table first, seed 0 of every model before seed 1, longest
first).
Every run is a child process (``one``) with its own log; at ``--deadline-s`` after the start the
running children are killed (their partial metrics are kept and marked), and runs not started are
marked ``not started``.  A run that fails does not stop the others.  Each run may also stop at its
time cap (``--run-cap-s``, the trainer's ``--time``): then it has fewer tokens than the others and
the report marks it.

``one``: train one run with :func:`lintime.training.train` (data order from the run's ``seed``,
initial weights from its ``init_seed``: ``quality_plan``), then score its checkpoint at the
training context and at 2x / 4x it with :func:`lintime.evaluation.evaluate`; writes
``<out>/runs/<id>/result.json`` and copies the run's ``metrics.jsonl`` and ``config.json`` there
(no checkpoints: they stay in ``--work``).

Usage::

    python3 benchmarks/quality/quality_run.py all --out OUT [--mode full|smoke|smoke-gpu]
        [--tokens N] [--seeds 0,1,2] [--tables main[,context,chunk]] [--gpus all|N]
        [--deadline-s 540] [--run-cap-s S] [--only ID_OR_GROUP,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_plan import DEFAULT_TABLES, DEFAULT_TOKENS, SEEDS, TABLES, Run, build_plan, describe, parse_ints  # noqa: E402

DATA = HERE / "data"
RESULT = "result.json"


def environment() -> dict:
    """Device, versions and date of this machine (written once per study)."""
    import torch

    env = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host_cpus": os.cpu_count(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else ["cpu"],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import lintime

        env["lintime"] = getattr(lintime, "__version__", None)
    except ImportError:
        env["lintime"] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                                           check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["git_commit"] = os.environ.get("LINTIME_COMMIT")
    corpus = DATA / "corpus.json"
    if corpus.exists():
        env["corpus"] = json.loads(corpus.read_text())
    return env


# ---------------------------------------------------------------------------------------------- one run


def run_one(run: Run, out: Path, work: Path, cap_s: float | None, device: str, log: Path | None = None) -> dict:
    """Train and evaluate ``run``; return (and write) its result record.  ``log``: append the
    trainer's lines there (else they are printed)."""
    import torch

    from lintime.evaluation import evaluate
    from lintime.training import TrainConfig, train
    from lintime.training.checkpoint import load_model

    dest = out / "runs" / run.id
    dest.mkdir(parents=True, exist_ok=True)
    record: dict = {"run": _run_dict(run), "status": "running", "device": device}
    cfg = TrainConfig(
        preset=run.preset, corpus=str(DATA / "corpus"), cache_dir=str(DATA / "cache"), context_len=run.context_len,
        tokens_per_batch=run.tokens_per_batch, micro_batch_tokens=run.micro_batch_tokens, tokens=run.tokens,
        time_minutes=cap_s / 60 if cap_s else None, recipe=run.recipe, seed=run.seed, init_seed=run.init_seed,
        device=device,
        log_every=1, eval_every=max(1, run.steps // run.evals), eval_tokens=run.curve_eval_tokens,
        save_every=0, keep=1, plots=False, sample_tokens=0,
    )
    record["train_config"] = cfg.resolved().to_dict()
    run_dir = work / run.id
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    try:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                res = train(cfg, out=work, name=run.id, progress=False,
                            echo=lambda line: print(line, file=f, flush=True))
        else:
            res = train(cfg, out=work, name=run.id, progress=False, echo=print)
        record["train"] = {"steps": res.step, "tokens": res.tokens, "elapsed_s": res.elapsed_s, "val": res.val,
                           "first_loss": res.first_loss, "last_loss": res.last_loss}
        record["status"] = "ok" if res.tokens >= run.tokens else "time-capped"
        loaded = load_model(res.run_dir, device=device)
        record["n_params"] = loaded.model.num_parameters()
        val = _validation(loaded, cfg)
        amp = torch.bfloat16 if device.startswith("cuda") else None
        report = evaluate(loaded.model, val, run.eval_contexts, tokenizer=loaded.tokenizer,
                          max_tokens=run.final_eval_tokens, batch_tokens=max(run.eval_batch_tokens, max(run.eval_contexts)),
                          autocast=amp)
        record["eval"] = report.to_dict()
        if device.startswith("cuda"):
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as err:  # noqa: BLE001 - one failed run must not stop the study; the report shows why
        record["status"] = "failed"
        record["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
        raise
    finally:
        record["wall_s"] = time.perf_counter() - t0
        for name in ("metrics.jsonl", "config.json"):
            if (run_dir / name).exists():
                shutil.copy(run_dir / name, dest / name)
        (dest / RESULT).write_text(json.dumps(record, indent=1) + "\n")
        if os.environ.get("QUALITY_KEEP_CHECKPOINTS") != "1":  # kept for a later evaluation (passkey_sweep.py)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~300 MB each
    return record


def _validation(loaded, cfg):
    from lintime.data import open_prepared

    return open_prepared(cfg.cache_dir, "validation", loaded.tokenizer)


def _run_dict(run: Run) -> dict:
    import dataclasses

    d = dataclasses.asdict(run)
    d["steps"] = run.steps
    d["eval_contexts"] = list(run.eval_contexts)
    return d


# ---------------------------------------------------------------------------------------------- all runs


def visible_gpus(spec: str) -> list[str]:
    """GPU ids to use: ``all`` (every device torch sees, none on a CPU machine) or a count."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec != "all":
        if not spec.isdigit():
            raise SystemExit(f"--gpus takes 'all' or a number, got {spec!r}")
        n = min(n, int(spec))
    base = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in base.split(",")] if base else [str(i) for i in range(n)]
    return ids[:n]


def run_all(args) -> int:
    t_start = time.monotonic()
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus(args.gpus)
    if args.deadline_s is None:  # a GPU call's budget; a CPU smoke on a shared 2-core machine needs longer
        args.deadline_s = 540.0 if gpus else 1800.0
    deadline = t_start + args.deadline_s
    mode = args.mode or ("full" if gpus else "smoke")
    runs = build_plan(mode, tokens=args.tokens, seeds=args.seeds, tables=args.tables)
    if args.only:
        runs = select(runs, args.only.split(","))
    slots = gpus or [None] * max(args.cpu_slots, 1)
    env_record = environment() | {"mode": mode, "tokens_per_run": args.tokens, "deadline_s": args.deadline_s,
                                  "seeds": list(args.seeds), "tables": list(args.tables),
                                  "slots": [s if s is not None else "cpu" for s in slots]}
    (out / "study.json").write_text(json.dumps({"environment": env_record, "plan": [_run_dict(r) for r in runs]},
                                               indent=1) + "\n")
    print(describe(runs, len(slots), args.deadline_s), flush=True)

    work = Path(args.work)
    if not gpus and not args.cpu_slots:
        return _run_in_process(args, out, work, runs, mode, deadline, t_start)
    pending = list(runs)
    running: dict[int, tuple[subprocess.Popen, Run, float]] = {}
    status: dict[str, str] = {}
    while pending or running:
        for slot, (proc, run, started) in list(running.items()):
            if proc.poll() is not None:
                status[run.id] = _final_status(out, run, proc.returncode)
                print(f"[{time.monotonic() - t_start:6.0f} s] {run.id}: {status[run.id]} "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
                del running[slot]
        now = time.monotonic()
        if now >= deadline:
            break
        for slot in range(len(slots)):
            if slot in running or not pending:
                continue
            run = pending.pop(0)
            left = deadline - now
            cap = args.run_cap_s if args.run_cap_s else None
            # training may use what is left minus a reserve for the final evaluation and copy-out
            reserve = 20.0 if gpus else 5.0
            train_cap = max(left - reserve, 1.0) if cap is None else max(min(cap, left - reserve), 1.0)
            env = dict(os.environ)
            if slots[slot] is not None:
                env["CUDA_VISIBLE_DEVICES"] = slots[slot]
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(len(slots), 1))))
            cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--run", run.id, "--mode", mode,
                   "--tokens", str(args.tokens), "--seeds", ",".join(map(str, args.seeds)),
                   "--tables", ",".join(args.tables), "--out", str(out), "--work", str(work),
                   "--cap-s", f"{train_cap:.1f}", "--device", "cuda" if slots[slot] is not None else "cpu"]
            log = open(out / "logs" / f"{run.id}.log", "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            log.close()
            running[slot] = (proc, run, time.monotonic())
            print(f"[{now - t_start:6.0f} s] start {run.id} on {slots[slot] or 'cpu'} (train cap {train_cap:.0f} s)",
                  flush=True)
        time.sleep(0.5)
    for proc, run, _ in running.values():  # the deadline: stop what still runs, keep what it wrote
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc, run, _ in running.values():
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status[run.id] = "killed at the deadline"
        _mark(out, run, "killed", f"killed at the study deadline ({args.deadline_s:.0f} s)", work)
    for run in pending:
        status[run.id] = "not started (deadline)"
        _mark(out, run, "not-started", "not started before the study deadline", work)
    print(summary(out, runs, status, time.monotonic() - t_start), flush=True)
    return 0 if all(s == "ok" for s in status.values()) else 1


def select(runs: list[Run], names: list[str]) -> list[Run]:
    """The runs named by id (``flash-1024-s1``) or by group (``flash-1024``: all its seeds), in plan order."""
    wanted = {n.strip() for n in names if n.strip()}
    unknown = wanted - {r.id for r in runs} - {r.group for r in runs}
    if unknown:
        raise SystemExit(f"--only: unknown run id(s) or group(s) {sorted(unknown)}; ids: {[r.id for r in runs]}")
    return [r for r in runs if r.id in wanted or r.group in wanted]


def _run_in_process(args, out: Path, work: Path, runs: list[Run], mode: str, deadline: float, t_start: float) -> int:
    """No GPU: the runs one after the other in this process (a CPU smoke is mostly start-up cost
    otherwise); a run is not started after the deadline, and a failed one is recorded and skipped."""
    status: dict[str, str] = {}
    for run in runs:
        left = deadline - time.monotonic()
        if left <= 0:
            status[run.id] = "not started (deadline)"
            _mark(out, run, "not-started", "not started before the study deadline", work)
            continue
        cap = min(args.run_cap_s or left, left)
        t0 = time.monotonic()
        try:
            rec = run_one(run, out, work, cap, "cpu", log=out / "logs" / f"{run.id}.log")
            status[run.id] = rec["status"]
        except Exception as err:  # noqa: BLE001 - recorded in its result.json
            status[run.id] = f"failed: {type(err).__name__}"
        print(f"[{time.monotonic() - t_start:6.0f} s] {run.id}: {status[run.id]} ({time.monotonic() - t0:.0f} s)",
              flush=True)
    print(summary(out, runs, status, time.monotonic() - t_start), flush=True)
    return 0 if all(s == "ok" for s in status.values()) else 1


def _final_status(out: Path, run: Run, rc: int) -> str:
    path = out / "runs" / run.id / RESULT
    if path.exists():
        rec = json.loads(path.read_text())
        return rec["status"] if rc == 0 or rec["status"] == "failed" else f"exit {rc} ({rec['status']})"
    return f"failed (exit {rc}, no result; see logs/{run.id}.log)"


def _mark(out: Path, run: Run, status: str, why: str, work: Path) -> None:
    """Record a run that did not finish; keep the metrics it wrote (curves up to the kill)."""
    dest = out / "runs" / run.id
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "config.json"):
        src = work / run.id / name
        if src.exists() and not (dest / name).exists():
            shutil.copy(src, dest / name)
    path = dest / RESULT
    rec = json.loads(path.read_text()) if path.exists() else {"run": _run_dict(run)}
    rec["status"], rec["error"] = status, why
    path.write_text(json.dumps(rec, indent=1) + "\n")


def summary(out: Path, runs: list[Run], status: dict[str, str], wall: float) -> str:
    lines = [f"quality study: {sum(s == 'ok' for s in status.values())}/{len(runs)} runs ok in {wall:.0f} s"]
    lines.append(f"{'run':24s} {'status':24s} {'tokens':>8s} {'train s':>8s} {'tok/s':>9s} {'val bpb':>8s}  eval bpb at 1x/2x/4x")
    for r in runs:
        path = out / "runs" / r.id / RESULT
        rec = json.loads(path.read_text()) if path.exists() else {}
        tr = rec.get("train") or {}
        ev = [x.get("bits_per_byte") for x in (rec.get("eval") or {}).get("results", [])]
        tps = tr["tokens"] / tr["elapsed_s"] if tr.get("elapsed_s") else None
        val = (tr.get("val") or {}).get("val_bpb")
        lines.append(f"{r.id:24s} {status.get(r.id, rec.get('status', '?'))[:24]:24s} "
                     f"{tr.get('tokens', 0) / 1e6:7.2f}M {tr.get('elapsed_s', 0):8.1f} {tps or 0:9.0f} "
                     f"{val if val is not None else float('nan'):8.4f}  "
                     + " / ".join("-" if v is None else f"{v:.4f}" for v in ev))
    return "\n".join(lines)


def _tables(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names or set(names) - set(TABLES):
        raise argparse.ArgumentTypeError(f"tables are a comma-separated subset of {','.join(TABLES)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="run the plan on every visible GPU (or the CPU)")
    a.add_argument("--out", type=Path, required=True, help="results folder (result.json, metrics, logs)")
    a.add_argument("--work", default=None, help="run folders with checkpoints (default OUT/../quality_work)")
    a.add_argument("--mode", choices=("full", "smoke", "smoke-gpu"), default=None,
                   help="default: full on GPUs, smoke on a CPU")
    a.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="training tokens per run (full mode)")
    a.add_argument("--seeds", type=parse_ints, default=SEEDS, help="comma-separated seeds (default 0,1,2)")
    a.add_argument("--tables", type=_tables, default=DEFAULT_TABLES,
                   help=f"comma-separated tables of {','.join(TABLES)} (default {','.join(DEFAULT_TABLES)})")
    a.add_argument("--gpus", default="all",
                   help="'all' or how many of the visible GPUs (restrict which with CUDA_VISIBLE_DEVICES)")
    a.add_argument("--deadline-s", type=float, default=None,
                   help="stop everything this long after the start (default 540 with GPUs, 1800 on a CPU)")
    a.add_argument("--run-cap-s", type=float, default=None, help="training-time cap per run (trainer --time)")
    a.add_argument("--only", default=None, help="comma-separated run ids or groups (a group: all its seeds)")
    a.add_argument("--cpu-slots", type=int, default=0,
                   help="without GPUs: run this many child processes at a time (default: in this process)")
    o = sub.add_parser("one", help="(used by 'all') train and evaluate one run")
    o.add_argument("--run", required=True)
    o.add_argument("--mode", default="full")
    o.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    o.add_argument("--seeds", type=parse_ints, default=SEEDS)
    o.add_argument("--tables", type=_tables, default=DEFAULT_TABLES)
    o.add_argument("--out", type=Path, required=True)
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--cap-s", type=float, default=None)
    o.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.cmd == "all":
        args.work = args.work or str(args.out.resolve().parent / f"{args.out.name}_work")
        if not (DATA / "cache" / "train.json").exists():
            raise SystemExit(f"no token cache under {DATA}: run `python3 benchmarks/quality/prepare_data.py` "
                             f"(or `--unpack` the carried archive) first")
        return run_all(args)
    runs = {r.id: r for r in build_plan(args.mode, tokens=args.tokens, seeds=args.seeds, tables=args.tables)}
    if args.run not in runs:
        raise SystemExit(f"unknown run {args.run!r}")
    try:
        run_one(runs[args.run], args.out, args.work, args.cap_s, args.device)
    except Exception:  # noqa: BLE001 - recorded in result.json; the traceback goes to the run's log
        import traceback

        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
