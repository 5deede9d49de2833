"""``lintime eval --task mqar | passkey | extrapolation``: run one task on a loaded checkpoint,
print its table, write its JSON and its plot (the ``lm`` task is :mod:`lintime.cli.eval` itself)."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path

from lintime.cli import CLIError


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        out = []
    if not out:
        raise CLIError(f"{flag} takes numbers separated by commas (e.g. 0,0.5,1), got {text!r}")
    return out


def parse_ints(text: str, flag: str) -> list[int]:
    out = []
    for p in text.split(","):
        p = p.strip().lower()
        mult = 1024 if p.endswith("k") else 1
        if not p.removesuffix("k").isdigit() or int(p.removesuffix("k")) == 0:
            raise CLIError(f"{flag} takes positive integers separated by commas, got {text!r}")
        out.append(int(p.removesuffix("k")) * mult)
    return list(dict.fromkeys(out))


def plot_path(json_path: str | None, plot: str | None, run: str, task: str) -> Path:
    """Where the plot goes: ``--plot``, else beside ``--json`` (same name, ``.png``), else
    ``eval_<task>.png`` in the run folder (the checkpoint's folder for a step folder)."""
    if plot:
        return Path(plot)
    if json_path:
        return Path(json_path).with_suffix(".png")
    return Path(run) / f"eval_{task}.png"


def vocabulary_of(loaded) -> str:
    """What the model's token ids are, for the header line: ``byte tokenizer`` for a language
    model; for a run trained on a synthetic task (``lintime train --task mqar``) the task's own
    vocabulary (its run folder stores a byte tokenizer only because the run-folder contract needs
    one)."""
    train = loaded.config.get("train") or {}
    task = train.get("task")
    if isinstance(task, str) and task != "lm":
        return f"{task} vocabulary {train.get('vocab_size', loaded.model.config.vocab_size)}"
    return f"{loaded.config['tokenizer']} tokenizer"


def run_task(task: str, loaded, *, checkpoint: str, opts: dict, given: set[str], autocast, progress: bool) -> dict:
    """Evaluate ``task``; print the table; return the JSON-able result (without the header
    fields :mod:`lintime.cli.eval` adds)."""
    if task == "mqar":
        return _mqar(loaded, opts, given, autocast)
    if task == "passkey":
        return _passkey(loaded, opts, given, autocast, progress)
    if task == "extrapolation":
        return _extrapolation(loaded, checkpoint, opts, autocast)
    raise CLIError(f"--task must be lm, mqar, passkey or extrapolation, got {task!r}")


def _mqar(loaded, opts, given, autocast) -> dict:
    from lintime.evaluation.tasks.mqar import MQARConfig, evaluate_mqar, format_mqar, parse_points

    train = loaded.config.get("train") or {}
    trained_on = train.get("task") == "mqar"
    base = MQARConfig.from_dict(train) if trained_on else MQARConfig(vocab_size=loaded.model.config.vocab_size)
    grid = "context_lens" in given or opts.get("kv_pairs")
    if opts.get("points"):
        if grid:
            raise CLIError("--points gives the settings: drop --context-lens / --kv-pairs")
        try:
            settings = parse_points(opts["points"])
        except ValueError as err:
            raise CLIError(f"--points: {err}") from None
    elif trained_on and train.get("mix") and not grid:  # a run trained on a mixture: its points
        settings = [(T, n) for T, n, _ in train["mix"]]
    else:
        seq_lens = parse_ints(opts["context_lens"], "--context-lens") if "context_lens" in given else [base.seq_len]
        pairs = parse_ints(opts["kv_pairs"], "--kv-pairs") if opts.get("kv_pairs") else [base.kv_pairs]
        settings = [(T, n) for T in seq_lens for n in pairs]
    seed = opts["seed"] if opts.get("seed") is not None else int(train.get("seed", 0))
    results = []
    for T, n in settings:
        try:
            cfg = MQARConfig(**{**base.to_dict(), "seq_len": T, "kv_pairs": n})
        except ValueError as err:
            raise CLIError(str(err)) from None
        results.append(evaluate_mqar(loaded.model, cfg, n_examples=opts["examples"], seed=seed, autocast=autocast))
    print(f"MQAR ({'the run' + chr(39) + 's task' if trained_on else 'not trained on it'}), "
          f"test stream of seed {seed}, {opts['examples']:,} examples per setting")
    print(format_mqar(results))
    return {"task": "mqar", "seed": seed, "trained_on_task": trained_on, "results": [r.to_dict() for r in results]}


def _passkey(loaded, opts, given, autocast, progress) -> dict:
    from lintime.evaluation.tasks.passkey import evaluate_passkey, format_passkey

    lens = parse_ints(opts["context_lens"], "--context-lens")
    depths = parse_floats(opts["depths"], "--depths")

    def tick(done: int, total: int) -> None:
        if progress:
            print(f"lintime eval: passkey {done}/{total} cells", file=sys.stderr, flush=True)

    try:
        report = evaluate_passkey(loaded.model, loaded.tokenizer, lens, depths, trials=opts["trials"],
                                  digits=opts["digits"], seed=opts.get("seed") or 0, autocast=autocast, progress=tick)
    except ValueError as err:
        raise CLIError(str(err)) from None
    print(f"passkey retrieval: {opts['digits']}-digit keys in {report.filler}, {opts['trials']} trials per cell, "
          "accuracy of greedy decoding")
    print(format_passkey(report))
    return {"task": "passkey", **report.to_dict()}


def _extrapolation(loaded, checkpoint, opts, autocast) -> dict:
    from lintime.evaluation import load_split
    from lintime.evaluation.tasks.extrapolation import evaluate_extrapolation, format_extrapolation

    trained = (loaded.config.get("train") or {}).get("context_len")
    if trained is None and opts.get("bucket") is None:
        raise CLIError(f"{checkpoint} does not say its training context: give --bucket (the window is --factor x it)")
    dataset = load_split(loaded.config, loaded.tokenizer, opts["split"], opts.get("data"), quiet=True)
    try:
        report = evaluate_extrapolation(loaded.model, dataset, tokenizer=loaded.tokenizer, trained_len=trained,
                                        factor=opts["factor"], bucket=opts.get("bucket"),
                                        max_windows=opts.get("max_windows"), autocast=autocast)
    except ValueError as err:
        raise CLIError(str(err)) from None
    print(f"length extrapolation: {report.n_windows:,} windows of {report.window} tokens from {report.n_docs:,} "
          f"{report.split} documents, buckets of {report.bucket}")
    print(format_extrapolation(report))
    return {"task": "extrapolation", **report.to_dict()}


def plot_result(result: dict, path: Path, *, label: str, compare: list[str]) -> Path | None:
    """The task's figure; ``compare``: JSON files of earlier ``--task extrapolation`` runs drawn as
    further curves (one per model)."""
    from lintime.evaluation.tasks import extrapolation, mqar, passkey

    task = result["task"]
    if task == "mqar":
        rows = [mqar.MQARResult(**r) for r in result["results"]]
        mqar.plot_mqar(rows, path, title=f"MQAR accuracy: {label}")
    elif task == "passkey":
        cells = [passkey.PasskeyCell(**c) for c in result["cells"]]
        rep = passkey.PasskeyReport(result["digits"], result["seed"], result["filler"], cells)
        passkey.plot_passkey(rep, path, title=f"passkey retrieval: {label}")
    else:
        if result.get("skipped"):
            return None
        curves = {label: result}
        for other in compare:
            try:
                data = _json.loads(Path(other).read_text())
            except (OSError, ValueError) as err:
                raise CLIError(f"--compare {other}: not a readable JSON file ({err})") from None
            if data.get("task") != "extrapolation":
                raise CLIError(f"--compare {other}: not the JSON of a --task extrapolation run")
            curves[str(data.get("checkpoint", other))] = data
        extrapolation.plot_extrapolation(curves, path)
    return path
