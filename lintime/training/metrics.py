"""Metrics of a run: ``metrics.jsonl`` and ``metrics.csv`` (one row per logged step), optional
TensorBoard events, and PNG plots of the loss against steps and against wall-clock time.

Row fields (CSV columns, in order; empty / absent when not measured at that step):

``step``        optimiser steps done;
``tokens``      training tokens seen (``step * tokens_per_batch``);
``time_s``      training wall time in seconds (not counting validation and checkpoints);
``loss``        mean training loss per predicted token of this step (cross-entropy, nats);
``aux_loss``    weighted sum of the mixers' auxiliary losses (Transformer-VQ commitment);
``lr``          learning rate used by this step;
``grad_norm``   global gradient norm before clipping;
``tokens_per_s`` training throughput over the last logging interval;
``val_loss``    validation loss (nats per predicted token), at evaluation steps;
``val_bpb``     validation bits per byte (byte tokenizer), or
``val_ppl``     validation perplexity (other tokenizers).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from lintime.utils.io import atomic_write_text

COLUMNS = ("step", "tokens", "time_s", "loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_bpb", "val_ppl")
JSONL_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
PLOT_STEPS = "loss_vs_steps.png"
PLOT_TIME = "loss_vs_time.png"


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` / ``metrics.csv`` in ``run_dir`` (flushed per row).

    ``resume_step``: on resume, rows of steps after the checkpoint (written before a crash) are
    dropped first, so the files hold one consistent history.
    """

    def __init__(self, run_dir: str | os.PathLike, *, resume_step: int | None = None, tensorboard: bool = False):
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / JSONL_FILE
        self.csv_path = self.run_dir / CSV_FILE
        if resume_step is not None:
            _truncate_after(self.jsonl_path, self.csv_path, resume_step)
        new_csv = not self.csv_path.is_file()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._csv_file = open(self.csv_path, "a", encoding="utf-8", newline="")
        self._csv = csv.writer(self._csv_file)
        if new_csv:
            self._csv.writerow(COLUMNS)
            self._csv_file.flush()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import (
                SummaryWriter,  # needs the `tensorboard` package
            )

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        row = {k: v for k, v in row.items() if v is not None}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        self._csv.writerow([_fmt(row.get(c)) for c in COLUMNS])
        self._csv_file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, global_step=row["step"])

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Rows of ``metrics.jsonl`` (an empty list when there is none)."""
    path = Path(run_dir) / JSONL_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash
                continue
    return rows


def _truncate_after(jsonl_path: Path, csv_path: Path, step: int) -> None:
    if jsonl_path.is_file():
        rows = read_metrics(jsonl_path.parent)
        atomic_write_text(jsonl_path, "".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= step))
    if csv_path.is_file():
        with open(csv_path, encoding="utf-8", newline="") as f:
            lines = list(csv.reader(f))
        keep = [lines[0]] if lines else [list(COLUMNS)]
        for line in lines[1:]:
            try:
                if int(line[0]) <= step:
                    keep.append(line)
            except (ValueError, IndexError):
                continue
        buf = io.StringIO()
        csv.writer(buf).writerows(keep)
        atomic_write_text(csv_path, buf.getvalue())


def plot_metrics(run_dir: str | os.PathLike, *, title: str = "", bits_per_byte: bool | None = None) -> list[Path]:
    """Write ``loss_vs_steps.png`` and ``loss_vs_time.png`` into ``run_dir`` from its
    ``metrics.jsonl``: training and validation loss -- in bits per byte for a byte-level run
    (``bits_per_byte``; ``None``: when the rows hold ``val_bpb``), else nats per token -- with the
    learning rate on a second axis.  Returns the files written (none without metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if not train and not val:
        return []
    if bits_per_byte is None:
        bits_per_byte = any("val_bpb" in r for r in val)
    unit = 1 / math.log(2) if bits_per_byte else 1.0  # nats per byte-token -> bits per byte
    y_label = "bits per byte" if bits_per_byte else "loss (nats / token)"
    out = []
    for x_key, x_label, fname in (("step", "step", PLOT_STEPS), ("time_s", "wall-clock time (min)", PLOT_TIME)):
        scale = 1 / 60 if x_key == "time_s" else 1
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        lines = []
        if train:
            lines += ax.plot([r[x_key] * scale for r in train], [r["loss"] * unit for r in train], lw=1, alpha=0.8,
                             label="train")
        if val:
            lines += ax.plot([r[x_key] * scale for r in val], [r["val_loss"] * unit for r in val], "o-", ms=4,
                             label="validation")
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        finite = [r["loss"] for r in train if math.isfinite(r["loss"])] + [r["val_loss"] for r in val if math.isfinite(r["val_loss"])]
        if finite and max(finite) > 4 * min(finite) > 0:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        with_lr = [r for r in train if "lr" in r]
        if with_lr:
            ax_lr = ax.twinx()
            lines += ax_lr.plot([r[x_key] * scale for r in with_lr], [r["lr"] for r in with_lr], color="gray", lw=1,
                                ls="--", label="learning rate")
            ax_lr.set_ylabel("learning rate")
            ax_lr.set_ylim(bottom=0)
        ax.legend(lines, [ln.get_label() for ln in lines])
        if title:
            ax.set_title(title)
        fig.tight_layout()
        path = run_dir / fname
        tmp = run_dir / f".{fname}.tmp.png"
        fig.savefig(tmp)
        plt.close(fig)
        os.replace(tmp, path)
        out.append(path)
    return out
