"""Passkey retrieval at 1k-32k on trained models (issue 31: "passkey at 1k-32k on the quality
study's models"), with :func:`lintime.evaluation.tasks.passkey.evaluate_passkey`.

Every model is loaded once (bf16 autocast on CUDA); then lengths go outermost -- every model at
1k, then every model at 2k, ... -- so a sweep cut by ``--deadline-s`` loses the longest lengths of
all models alike, and the lengths not reached are recorded as not run.  The prompts of one length
(every depth) are decoded together, :data:`BATCH` prompts or :data:`BATCH_TOKENS` tokens at a
time.  Expected time for 1k-32k on the quality
study's eight ``-medium`` models, from the 1k-8k run's per-call cost (~30-60 ms an eager call):
~70-110 s with the loading, inside the default 170 s deadline (measured: 94 s for the eight models at
1k-32k, H200, 2026-11-27).  A model that fails (an
out-of-memory error at 32k, say) is recorded with its error and the others go on.

Writes ``passkey_sweep.json`` (settings, device, per model its run folder, family, trained context
and every (length, depth) cell with its answers), ``passkey_sweep.md`` (mean accuracy over the
depths, one row per model) and ``passkey_sweep.png`` (that mean against the length, one line per
model) into ``--out``; ``benchmarks/recall_sweep.py --report ... --passkey passkey_sweep.json``
puts them on docs/results_recall.md.

    python3 benchmarks/passkey_sweep.py RUN [RUN ...] --out out/passkey      # a RUN may be a folder of runs
    python3 benchmarks/passkey_sweep.py RUN --tiny --out /tmp/pk             # seconds on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# prompts per batch: at most a length's 40 (5 depths x 8 trials) and BATCH_TOKENS prompt tokens,
# so 1 batch at 1k-4k, 2 at 8k, 3 at 16k, 5 at 32k: 176 model calls per model for 1k-32k instead of
# 355 in batches of 8 -- a medium model's call is mostly fixed host work (H200, 2026-11-27,
# batches of 8: 0.3-3 s per model and length, about the same at 1k and 8k) -- while no batch
# holds more than 8 prompts of 32k (the old batches' memory at 32k; a softmax model's fp32 cache
# of 8 x 32k is ~9 GB, twice that while a call writes its new state)
BATCH = 40
BATCH_TOKENS = 8 * 32768


def find_runs(paths: list[str]) -> list[Path]:
    """The run folders meant by ``paths``: a folder with a ``config.json`` is a run; any other
    folder stands for its subfolders that are runs (sorted).  A run without a checkpoint is kept:
    loading it reports the error."""
    runs: list[Path] = []
    for text in paths:
        path = Path(text)
        if (path / "config.json").is_file():
            runs.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
            if not found:
                raise SystemExit(f"{path}: neither a run folder (config.json) nor a folder of runs")
            runs.extend(found)
        else:
            raise SystemExit(f"{path}: no such folder")
    return runs


def _parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return out


def sweep(models: list[dict], loaded: dict, lengths: list[int], depths: list[float], *, trials: int, digits: int,
          seed: int, batch_size: int, chunk_size: int, autocast, deadline: float, batch_tokens: int = 0, say=print,
          clock=time.monotonic) -> None:
    """Fill each model record's ``cells`` length by length (every model at one length before the
    next); ``loaded[name]`` is the model's :class:`~lintime.training.checkpoint.LoadedModel`.
    Stops starting work at ``deadline`` (a ``clock`` time) and lists the lengths not reached in
    ``not_run``."""
    from lintime.evaluation.tasks.passkey import evaluate_passkey

    for m in models:
        m.setdefault("cells", [])
        m.setdefault("not_run", [])
    for L in lengths:
        for m in models:
            if m.get("error") or m["name"] not in loaded:
                continue
            if clock() >= deadline:
                m["not_run"].append(L)
                continue
            t0 = clock()
            try:
                lm = loaded[m["name"]]
                rep = evaluate_passkey(lm.model, lm.tokenizer, [L], depths, trials=trials, digits=digits, seed=seed,
                                       batch_size=rows_per_batch(L, batch_size, batch_tokens),
                                       chunk_size=chunk_size, autocast=autocast)
                m["cells"].extend(rep.to_dict()["cells"])
                got = [c for c in rep.cells if not c.skipped]
                acc = sum(c.correct for c in got) / max(sum(c.trials for c in got), 1)
                say(f"{m['name']:>28} {L:>6}: " + ("skipped" if not got else f"accuracy {acc:.2f}")
                    + f" ({clock() - t0:.1f} s)")
            except Exception as err:  # one model's failure (memory at 32k) does not stop the others
                m["error"] = f"at {L}: {type(err).__name__}: {' '.join(str(err).split())[:300]}"
                say(f"{m['name']:>28} {L:>6}: {m['error']}")
                _free_memory()


def rows_per_batch(length: int, batch_size: int, batch_tokens: int = 0) -> int:
    """Prompts of ``length`` tokens per batch: ``batch_size``, fewer where they would hold more than
    ``batch_tokens`` tokens (0: no token bound), at least one."""
    if batch_tokens <= 0:
        return batch_size
    return max(1, min(batch_size, batch_tokens // length))


def _free_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mean_by_length(model: dict) -> dict[int, float | None]:
    """``{length: mean accuracy over the depths}`` (None where skipped)."""
    out: dict[int, float | None] = {}
    for L in sorted({c["context_len"] for c in model.get("cells", [])}):
        got = [c for c in model["cells"] if c["context_len"] == L]
        if any(c.get("skipped") for c in got):
            out[L] = None
        else:
            out[L] = sum(c["correct"] for c in got) / sum(c["trials"] for c in got)
    return out


def table(data: dict) -> str:
    lens = data["settings"]["lengths"]
    lines = ["| model | trained at | " + " | ".join(f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in lens) + " |",
             "|---|---|" + "---|" * len(lens)]
    for m in data["models"]:
        means = mean_by_length(m)
        cells = []
        for L in lens:
            if L in means:
                cells.append("skipped" if means[L] is None else f"{means[L]:.2f}")
            else:
                cells.append("failed" if m.get("error") else "not run")
        lines.append(f"| {m['name']} | {m.get('trained_context') or '?'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for m in data["models"]:
        pts = sorted((L, a) for L, a in mean_by_length(m).items() if a is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=m["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("passkey accuracy (mean over depths)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _environment(cuda: bool) -> dict:
    import torch

    from lintime.bench.measure import git_commit

    commit = git_commit() or ""  # LINTIME_GIT_COMMIT where the copy's .git is stale (a remote GPU machine)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu"),
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (made by lintime train), or folders holding run folders")
    p.add_argument("--out", required=True, help="folder for passkey_sweep.json / .md / .png")
    p.add_argument("--lengths", default=",".join(f"{L // 1024}k" for L in LENGTHS), help="context lengths (k = x1024)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEPTHS))
    p.add_argument("--trials", type=int, default=8, help="prompts per (length, depth)")
    p.add_argument("--digits", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=BATCH,
                   help="prompts decoded together (of one length, any depths)")
    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS,
                   help="at most this many prompt tokens per batch (fewer prompts at long lengths; 0 = no bound)")
    p.add_argument("--chunk-size", type=int, default=4096, help="prefill piece (tokens)")
    p.add_argument("--deadline-s", type=float, default=170.0, help="start no length after this many seconds")
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="a seconds-long CPU check: lengths 128,256, 2 depths, 2 trials")
    args = p.parse_args(argv)
    if args.tiny:
        args.lengths, args.depths, args.trials, args.device = "128,256", "0,1", 2, "cpu"

    import torch

    from lintime.training.checkpoint import load_model
    from lintime.utils.device import autocast_dtype, pick_device

    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: more threads were slower (docs/cli.md)
    amp = autocast_dtype(device, "auto")
    lengths = _parse_lengths(args.lengths)
    depths = [float(d) for d in args.depths.split(",")]
    models, loaded = [], {}
    for run in find_runs(args.runs):
        m = {"name": run.name, "run": str(run)}
        try:
            lm = load_model(run, device=device)
            cfg = lm.model.config
            m.update(family=cfg.family, step=lm.step, n_params=lm.model.num_parameters(),
                     trained_context=(lm.config.get("train") or {}).get("context_len"),
                     position=getattr(cfg, "position", None))
            loaded[run.name] = lm
        except Exception as err:  # a run without a checkpoint is reported, the others go on
            m["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        models.append(m)
        print(f"{run}: " + (m["error"] if "error" in m else f"{m['family']}, step {m['step']}, "
                                                             f"{m['n_params'] / 1e6:.1f}M parameters"), flush=True)
    sweep(models, loaded, lengths, depths, trials=args.trials, digits=args.digits, seed=args.seed,
          batch_size=args.batch_size, chunk_size=args.chunk_size, autocast=amp, deadline=deadline,
          batch_tokens=args.batch_tokens,
          say=lambda line: print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"lengths": lengths, "depths": depths, "trials": args.trials, "digits": args.digits, "seed": args.seed,
                "batch_size": args.batch_size, "batch_tokens": args.batch_tokens, "chunk_size": args.chunk_size,
                "deadline_s": args.deadline_s,
                "filler": "stdlib (test split)", "precision": "bf16 autocast" if amp is not None else "fp32"}
    data = {**_environment(device.type == "cuda"), "settings": settings,
            "seconds": round(time.monotonic() - t0, 1), "models": models}
    (out / "passkey_sweep.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "passkey_sweep.md").write_text(table(data) + "\n")
    try:
        plot(data, out / "passkey_sweep.png")
    except ImportError as err:  # the results are in the JSON; recall_sweep.py --report draws the plot
        print(f"no plot ({err}); recall_sweep.py --report draws it from the JSON")
    print(table(data))
    print(f"wrote {out / 'passkey_sweep.json'}, passkey_sweep.md and passkey_sweep.png ({data['seconds']:.0f} s)")
    return 0 if not any(m.get("error") for m in models) else 1


if __name__ == "__main__":
    sys.exit(main())
