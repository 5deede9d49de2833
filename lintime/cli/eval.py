"""``lintime eval``: held-out bits per byte / perplexity of a checkpoint at several context lengths."""

from __future__ import annotations

import json as _json
import sys
import time
from pathlib import Path

from lintime.cli import CLIError, check_writable, command, set_threads

PROGRESS_EVERY_S = 30.0  # without a terminal, a progress line this often


def parse_context_lens(text: str) -> list[int]:
    """``"512,1024,2k"`` -> ``[512, 1024, 2048]`` (a ``k`` suffix is x1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        digits = part.removesuffix("k")
        if not digits.isdigit() or int(digits) == 0:
            raise CLIError(f"--context-lens takes positive integers separated by commas (e.g. 512,1024,2k), got {text!r}")
        out.append(int(digits) * mult)
    return list(dict.fromkeys(out))  # keep order, drop repeats


@command
def eval(
    checkpoint: str,
    split: str = "validation",
    context_lens: str = "512,1024,2048",
    max_tokens: int | None = None,
    batch_tokens: int = 8192,
    data: str | None = None,
    device: str = "auto",
    precision: str = "auto",
    json: str | None = None,
    progress: bool = True,
    threads: int = 0,
    task: str = "lm",
    kv_pairs: str | None = None,
    points: str | None = None,
    examples: int = 3000,
    depths: str = "0,0.25,0.5,0.75,1",
    trials: int = 10,
    digits: int = 5,
    factor: int = 8,
    bucket: int | None = None,
    max_windows: int = 64,
    seed: int | None = None,
    plot: str | None = None,
    compare: str | None = None,
    _given: frozenset[str] | None = None,
) -> None:
    """Score a causal LM on held-out text: bits per byte (and perplexity for BPE) at several
    context lengths, including lengths longer than it was trained on (length extrapolation).

    One exact pass over the split: every document's tokens (and its eos) are predicted once,
    from windows of each context length aligned to the document's start; windows are
    independent (no state carried across them).  --task mqar | passkey | extrapolation runs one of
    the offline tasks instead (table, --json, and a plot).  See docs/cli_eval.md.

    Args:
        checkpoint: run folder (its latest checkpoint), a step folder (runs/NAME/checkpoints/step_N) or a folder written by lintime export (needs --data).
        split: validation or test.
        context_lens: context lengths, comma-separated (a k suffix means x1024).
        max_tokens: score only the first documents of the split, up to about this many tokens (whole documents).
        batch_tokens: tokens per forward pass (windows are packed with cu_seqlens).
        data: a corpus spec or a prepared cache folder (default: the run's training data, held-out split).
        device: auto (cuda when available), cpu, cuda or cuda:N.
        precision: auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16.
        json: also write the results to this JSON file (checked for writability before the evaluation).
        progress: show progress on stderr (on a terminal a live line, elsewhere a line every 30 seconds).
        threads: CPU threads (0 = auto: 1 for models under 20M parameters, else PyTorch's default).
        task: lm (bits per byte at each context length), mqar (associative recall accuracy), passkey (retrieval accuracy against depth and context) or extrapolation (bits per byte by position bucket).
        kv_pairs: mqar: key-value pairs per example, comma-separated (default: the run's task setting, else 4).
        points: mqar: settings as LENxPAIRS, comma-separated (e.g. 64x4,512x128,1024x256), instead of the --context-lens x --kv-pairs grid (default for a run trained on a --mqar-mix: its points).
        examples: mqar: test examples per setting.
        depths: passkey: depths of the key in the context, fractions separated by commas.
        trials: passkey: prompts per (context length, depth).
        digits: passkey: digits of the key.
        factor: extrapolation: the window is this many times the training context.
        bucket: extrapolation: positions per bucket (default: the training context).
        max_windows: extrapolation: score at most this many windows (0 = all).
        seed: mqar / passkey: the seed of the examples (mqar default: the run's seed, i.e. its held-out test stream).
        plot: where the task's plot goes (default: beside --json, else eval_<task>.png in the checkpoint folder).
        compare: extrapolation: JSON files of earlier --task extrapolation runs to draw as further curves, comma-separated.
    """
    from lintime.cli.loading import load_checkpoint
    from lintime.utils.device import pick_device

    lens = _check_options(context_lens, precision, max_tokens, batch_tokens, json)
    dev = pick_device(device)
    loaded = load_checkpoint(checkpoint, device=dev)
    set_threads(threads, device=str(dev), n_params=loaded.model.num_parameters())
    if loaded.config["objective"] != "clm":
        raise CLIError(f"{checkpoint} is a masked LM ({loaded.config['objective']}): eval scores causal LMs")
    if task != "lm":
        # from Python, a context_lens other than the default counts as given (the CLI says which were)
        given = set(_given) if _given is not None else ({"context_lens"} if context_lens != "512,1024,2048" else set())
        opts = dict(context_lens=context_lens, kv_pairs=kv_pairs, points=points, examples=examples, depths=depths, trials=trials,
                    digits=digits, factor=factor, bucket=bucket, max_windows=max_windows or None, seed=seed,
                    split=split, data=data)
        return _eval_task(task, loaded, checkpoint, dev, precision, json, plot, compare, progress, given=given, opts=opts)
    _eval_lm(loaded, checkpoint, dev, lens, split=split, data=data, max_tokens=max_tokens, batch_tokens=batch_tokens,
             precision=precision, json=json, progress=progress)


def _check_options(context_lens: str, precision: str, max_tokens: int | None, batch_tokens: int,
                   json: str | None) -> list[int]:
    """The context lengths of ``--context-lens``, after the checks of the flags that need no checkpoint."""
    lens = parse_context_lens(context_lens)
    if precision not in ("auto", "fp32", "bf16"):
        raise CLIError(f"--precision must be auto, fp32 or bf16, got {precision!r}")
    if max_tokens is not None and max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {max_tokens}")
    if batch_tokens < 1:
        raise CLIError(f"--batch-tokens must be >= 1, got {batch_tokens}")
    if json is not None:
        check_writable(Path(json).parent, "--json")
    return lens


def _eval_lm(loaded, checkpoint, dev, lens, *, split, data, max_tokens, batch_tokens, precision, json, progress) -> None:
    """``--task lm``: bits per byte (perplexity for BPE) of ``split`` at each context length of ``lens``."""
    from lintime.evaluation import evaluate, load_split
    from lintime.utils.device import autocast_dtype
    from lintime.utils.io import atomic_write_text

    dataset = load_split(loaded.config, loaded.tokenizer, split, data, quiet=not progress)
    trained = (loaded.config.get("train") or {}).get("context_len")

    live = progress and sys.stderr.isatty()
    last = [time.monotonic()]

    def tick(L: int, done: int, total: int) -> None:
        if live:
            print(f"\r  context {L}: {done:,}/{total:,} tokens", end="", file=sys.stderr, flush=True)
        elif progress and (time.monotonic() - last[0] >= PROGRESS_EVERY_S or done == total):
            last[0] = time.monotonic()
            print(f"lintime eval: context {L}: {done:,}/{total:,} tokens", file=sys.stderr, flush=True)

    report = evaluate(loaded.model, dataset, lens, tokenizer=loaded.tokenizer, max_tokens=max_tokens,
                      batch_tokens=batch_tokens, autocast=autocast_dtype(dev, precision), progress=tick)
    if live:
        print("\r\033[K", end="", file=sys.stderr, flush=True)

    model_cfg = loaded.config["model"]
    step = f"step {loaded.step}" if loaded.step >= 0 else "exported model"
    print(f"{checkpoint}: {step}, {model_cfg.get('family', '?')} family, "
          f"{loaded.config['tokenizer']} tokenizer" + (f", trained at context {trained}" if trained else ""))
    which = (f"its first {report.n_docs:,} of {len(dataset):,} documents (--max-tokens {max_tokens:,})"
             if report.n_docs < len(dataset) else f"all {report.n_docs:,} documents")
    print(f"{report.split} split, {which}: {report.n_bytes:,} bytes, {report.n_targets:,} tokens to predict, "
          f"each once, in windows from its document's start")
    print(format_table(report, trained, bpe=not loaded.tokenizer.bits_per_byte))

    if json is not None:
        out = {
            "checkpoint": str(checkpoint),
            "step": loaded.step,
            "model": model_cfg,
            "trained_context_len": trained,
            "device": str(dev),
            "precision": precision,
            **report.to_dict(),
        }
        path = Path(json)
        atomic_write_text(path, _json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")


def _eval_task(task, loaded, checkpoint, dev, precision, json, plot, compare, progress, *, given, opts) -> None:
    """``--task mqar | passkey | extrapolation`` (:mod:`lintime.cli.eval_tasks`)."""
    from lintime.cli.eval_tasks import plot_path, plot_result, run_task, vocabulary_of
    from lintime.utils.device import autocast_dtype
    from lintime.utils.io import atomic_write_text

    if plot is not None:
        check_writable(Path(plot).parent, "--plot")
    model_cfg = loaded.config["model"]
    step = f"step {loaded.step}" if loaded.step >= 0 else "exported model"
    print(f"{checkpoint}: {step}, {model_cfg.get('family', '?')} family, d_model {model_cfg.get('d_model')}, "
          f"{vocabulary_of(loaded)}")
    result = run_task(task, loaded, checkpoint=checkpoint, opts=opts, given=given,
                      autocast=autocast_dtype(dev, precision), progress=progress)
    out = {"checkpoint": str(checkpoint), "step": loaded.step, "model": model_cfg, "device": str(dev),
           "precision": precision, **result}
    if json is not None:
        atomic_write_text(Path(json), _json.dumps(out, indent=2) + "\n")
        print(f"wrote {json}")
    run = Path(checkpoint)
    where = plot_path(json, plot, str(run if run.is_dir() else run.parent), task)
    drawn = plot_result(out, where, label=Path(checkpoint).name,
                        compare=[c for c in (compare or "").split(",") if c.strip()])
    if drawn is not None:
        print(f"wrote {drawn}")


def format_table(report, trained: int | None, *, bpe: bool) -> str:
    head = ["context", "bits/byte", "bits/token", "loss"] + (["perplexity"] if bpe else []) + ["windows", "tokens/s"]
    rows = []
    for r in report.results:
        mark = "*" if trained and r.context_len > trained else ""
        if r.skipped:
            rows.append([f"{r.context_len}{mark}", f"skipped: {r.skipped}"])
            continue
        rows.append([f"{r.context_len}{mark}", f"{r.bits_per_byte:.4f}", f"{r.bits_per_token:.4f}", f"{r.loss:.4f}"]
                    + ([f"{r.perplexity:.2f}"] if bpe else []) + [f"{r.n_windows:,}", f"{r.tokens_per_s:,.0f}"])
    widths = [max([len(head[i])] + [len(row[i]) for row in rows if len(row) > 2]) for i in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    for row in rows:
        if len(row) == 2:
            lines.append(f"{row[0].rjust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if trained and any(r.context_len > trained for r in report.results):
        lines.append(f"* longer than the training context ({trained}): length extrapolation")
    return "\n".join(lines)
