"""What every task's report shares: a text table and a PNG figure."""

from __future__ import annotations

import contextlib
from pathlib import Path


def table(head: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns; a row shorter than ``head`` (e.g. ``[name, "skipped: ..."]``) puts
    its last cell, unpadded, after the columns it fills."""
    full = [r for r in rows if len(r) == len(head)]
    widths = [max([len(head[i])] + [len(r[i]) for r in full]) for i in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    for r in rows:
        if len(r) == len(head):
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        else:
            lines.append("  ".join([c.rjust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]))
    return "\n".join(lines)


@contextlib.contextmanager
def figure(path, title: str, xlabel: str, ylabel: str):
    """Yield a matplotlib axis (Agg backend), then save the figure to ``path`` (a PNG) with a
    legend when there are labelled lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    try:
        yield ax
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
