"""Run bench cases: a table on stdout, JSON (written after every case, so an interrupted run
keeps what it measured) and, with matplotlib, one figure of time against context length."""

from __future__ import annotations

import inspect
import json
import os
import time

import torch

from lintime.bench import as_row, select
from lintime.bench.measure import environment


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (f"{'case':<22} {'impl':<30} {'T':>6} {'B':>3} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8} "
            f"{'GB/s':>7}  notes")
    lines = [head, "-" * len(head)]
    for r in rows:
        notes = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.get("extra", {}).items())
        lines.append(
            f"{r['case']:<22} {r['impl']:<30} {r['T']:>6} {r['B']:>3} {_fmt(r.get('fwd_ms'), '9.3f')} "
            f"{_fmt(r.get('fwdbwd_ms'), '11.3f')} {_fmt(r.get('tflops_fwdbwd'), '8.1f')} "
            f"{_fmt(r.get('gbps_fwdbwd'), '7.0f')}  {notes}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = sorted({r["case"] for r in rows if r.get("fwdbwd_ms") or r.get("fwd_ms")})
    if not cases:
        return False
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for impl in sorted({r["impl"] for r in rows if r["case"] == case}):
            pts = sorted((r["T"], r.get("fwdbwd_ms") or r.get("fwd_ms")) for r in rows
                         if r["case"] == case and r["impl"] == impl and (r.get("fwdbwd_ms") or r.get("fwd_ms")))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens per sequence)")
        ax.set_ylabel("ms (fwd+bwd where measured)")
        ax.set_title(case)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def run_ops(cases: str = "all", out: str = "bench_out", quick: bool = False) -> list[dict]:
    if not torch.cuda.is_available():
        raise ValueError("lintime bench ops needs a CUDA device")
    os.makedirs(out, exist_ok=True)
    chosen = select(cases)
    torch.manual_seed(0)
    env = environment()
    print(json.dumps(env), flush=True)
    results, rows, errors = [], [], {}
    path = os.path.join(out, "bench_ops.json")
    for name, fn in chosen:
        t0 = time.time()
        n0 = len(results)
        kwargs = {"quick": quick} if "quick" in inspect.signature(fn).parameters else {}
        try:
            fn(results, **kwargs)
        except Exception as e:  # one broken case must not cost the others' numbers
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"[{name}] FAILED: {errors[name]}", flush=True)
        new = [as_row(r) for r in results[n0:]]
        rows.extend(new)
        print(table(new), flush=True)
        print(f"[{name}] {time.time() - t0:.0f} s", flush=True)
        with open(path, "w") as f:
            json.dump({"env": env, "errors": errors, "results": rows}, f, indent=1)
    print(table(rows))
    if plot(rows, os.path.join(out, "bench_ops.png")):
        print(f"plot: {os.path.join(out, 'bench_ops.png')}")
    print(f"wrote {path}")
    return rows
