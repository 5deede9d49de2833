"""``lintime bench model``'s outputs: text tables, ``bench_model.json``, the two plots, and the merge of
several runs' JSON files into one."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence


def fmt_size(n: int) -> str:
    """A context length as ``1k`` / ``64k`` (multiples of 1024), else the number."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _f(x, spec: str) -> str:
    """``x`` formatted by ``spec``; ``None`` (a value not measured) as ``-`` right-aligned to the
    spec's width, so the columns after it stay in place."""
    if x is None:
        width = re.match(r"\d*", spec).group()
        return "-".rjust(int(width) if width else 1)
    return format(x, spec)


# (header, row key, format spec) of the columns after ``preset`` and before ``status``; spec ``None``: a
# context length (1k, 64k), ``str<n>``: text n wide
_TRAIN_COLUMNS = (("T", "T", None), ("rows", "rows", "5"), ("step ms", "step_ms", "9.1f"),
                  ("p10", "step_p10_ms", "9.1f"), ("p90", "step_p90_ms", "9.1f"),
                  ("tokens/s", "tokens_per_s", "10,.0f"), ("peak MiB", "peak_mib", "9,.0f"))
_DECODE_COLUMNS = (("L", "L", None), ("B", "batch", "3"), ("path", "path", "str15"), ("ms/token", "token_ms", "9.2f"),
                   ("p10", "token_p10_ms", "8.2f"), ("p90", "token_p90_ms", "8.2f"),
                   ("tokens/s", "tokens_per_s", "9,.0f"), ("prefill tok/s", "prefill_tokens_per_s", "13,.0f"),
                   ("state MiB", "state_mib", "10.3f"), ("peak MiB", "peak_mib", "9,.0f"))


def _width(spec) -> int:
    if spec is None:
        return 6
    return int(spec[3:]) if spec.startswith("str") else int(re.match(r"\d*", spec).group())


def _cell(r: dict, key: str, spec) -> str:
    if spec is None:
        return f"{fmt_size(r[key]):>6}"
    if spec.startswith("str"):
        return f"{str(r.get(key) or '-'):>{_width(spec)}}"
    return _f(r.get(key), spec)


def _table(rows: Sequence[dict], columns) -> str:
    """Fixed-width text table: ``preset``, ``columns`` (``-`` where not measured), ``status (note)``."""
    head = f"{'preset':<20} " + " ".join(f"{h:>{_width(sp)}}" for h, _, sp in columns) + "  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [_cell(r, k, sp) for _, k, sp in columns]
        status = r["status"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(f"{r['preset']:<20} " + " ".join(cells) + f"  {status}")
    return "\n".join(lines)


def train_table(rows: Sequence[dict]) -> str:
    return _table(rows, _TRAIN_COLUMNS)


def decode_table(rows: Sequence[dict]) -> str:
    return _table(rows, _DECODE_COLUMNS)


def plot(result: dict, out: str) -> list[str]:
    """Log-log figures, one line per preset (only ``ok`` rows are drawn; OOM and skipped points
    are in the table and the JSON): ``bench_model_train.png`` (tokens/s and peak memory against
    T), ``bench_model_decode.png`` (ms per token and state MiB per sequence against L).
    Returns the paths written ([] without matplotlib or without data)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    panels = {
        "train": ("T", [("tokens_per_s", "training tokens/s"), ("peak_mib", "peak memory (MiB)")],
                  "T (training context, tokens)"),
        "decode": ("L", [("token_ms", "decoding ms per token"), ("state_mib", "state MiB per sequence")],
                   "L (decoding context, tokens)"),
    }
    for part, (xkey, ys, xlabel) in panels.items():
        rows = [r for r in result.get(part, []) if r["status"] == "ok"]
        if not rows:
            continue
        fig, axes = plt.subplots(1, len(ys), figsize=(6 * len(ys), 4.5), squeeze=False)
        for ax, (ykey, ylabel) in zip(axes[0], ys):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            drawn = False
            paths = {r.get("path") for r in rows}
            for preset, path in dict.fromkeys((r["preset"], r.get("path")) for r in rows):
                pts = sorted((r[xkey], r[ykey]) for r in rows
                             if r["preset"] == preset and r.get("path") == path and r.get(ykey))
                if pts:  # one line per preset, per decoding path where a run has several
                    ax.plot(*zip(*pts), marker="o", label=preset if len(paths) == 1 else f"{preset} ({path})")
                    drawn = True
            if not drawn:  # e.g. peak memory on CPU
                ax.text(0.5, 0.5, "not measured on this device", ha="center", va="center", transform=ax.transAxes)
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        env = result.get("env", {})
        fig.suptitle(f"lintime bench model ({part}) -- {env.get('device', '?')}, {result['settings'].get('dtype')}",
                     fontsize=9)
        fig.tight_layout()
        path = os.path.join(out, f"bench_model_{part}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(result: dict, out: str, echo: Callable[[str], None] = print, plots: bool = True) -> str:
    """Tables on ``echo``, ``bench_model.json`` and (``plots``) the plots in ``out``; returns the JSON path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bench_model.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if result.get("train"):
        echo("training step (fwd + bwd + AdamW), median of the timed steps\n" + train_table(result["train"]))
    if result.get("decode"):
        echo("decoding, per token\n" + decode_table(result["decode"]))
    for p in plot(result, out) if plots else ():
        echo(f"plot: {p}")
    echo(f"wrote {path}")
    return path


def merge(paths: Sequence[str]) -> dict:
    """Several ``bench_model.json`` files as one result (rows concatenated in the given order,
    ``env`` and ``settings`` of the first, the others' kept under ``parts``, the anchors' records
    of all): e.g. one file per
    preset from ``benchmarks/gpu_model.sh``.  A folder stands for its ``bench_model.json``."""
    results = []
    for p in paths:
        f = os.path.join(p, "bench_model.json") if os.path.isdir(p) else p
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no bench_model.json at {p}")
        with open(f) as fh:
            try:
                results.append(json.load(fh))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f} is not JSON: {e}") from None
    if not results:
        raise ValueError("--from-json: no files given")
    first = results[0]
    merged = {"schema": first.get("schema", 1), "env": first.get("env", {}), "settings": first.get("settings", {}),
              "anchors": {}, "train": [], "decode": [],
              "parts": [{"file": p, "env": r.get("env"), "settings": r.get("settings")} for p, r in zip(paths, results)]}
    for r in results:
        merged["anchors"].update(r.get("anchors", {}))
        for key in ("train", "decode"):
            merged[key].extend(r.get(key, []))
    return merged

