"""The quality study's plots: every curve is the mean over a configuration's finished seeds with a
band of ± one spread (sample standard deviation), every point an error bar of the same; one seed
draws a plain line.  Nothing is drawn without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

from quality_plan import CHUNK_CONTEXT, CHUNK_SIZES, CONTEXT_MODELS, CONTEXTS, MAIN_CONTEXT, MODELS, REFERENCE
from quality_stats import groups, ok, stat


def mean_curve(runs: list[dict], key: str, points: int = 64) -> tuple[list[float], list[float], list[float]]:
    """``(x, mean, spread)`` of the finished seeds' validation curves against ``key``: on the
    seeds' common evaluation steps for ``step``; for ``time_s``, on a grid over the time all seeds
    cover (each curve interpolated linearly)."""
    curves = [s["curve"] for s in runs if ok(s) and s["curve"]]
    if not curves:
        return [], [], []
    if key == "step":
        common = sorted(set.intersection(*({p["step"] for p in c} for c in curves)))
        ys = [[next(p["bpb"] for p in c if p["step"] == x) for c in curves] for x in common]
        xs = [float(x) for x in common]
    else:
        lo, hi = max(c[0][key] for c in curves), min(c[-1][key] for c in curves)
        if hi <= lo:
            return [], [], []
        xs = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
        ys = [[_interp(c, x, key) for c in curves] for x in xs]
    stats = [stat(y) for y in ys]
    return xs, [s["mean"] for s in stats], [s["spread"] for s in stats]


def _interp(curve: list[dict], x: float, key: str) -> float:
    for a, b in zip(curve, curve[1:]):
        if a[key] <= x <= b[key]:
            f = 0.0 if b[key] == a[key] else (x - a[key]) / (b[key] - a[key])
            return a["bpb"] + f * (b["bpb"] - a["bpb"])
    return curve[-1]["bpb"] if x >= curve[-1][key] else curve[0]["bpb"]


def plots(summ: dict[str, dict], t: dict, assets: Path) -> list[str]:
    """PNG files (names relative to ``assets``); nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("quality_report: matplotlib not installed, no plots", file=sys.stderr)
        return []
    gs = groups(summ)
    made = []

    def save(fig, name: str, dpi: int = 110) -> None:
        fig.tight_layout()
        fig.savefig(assets / name, dpi=dpi)
        plt.close(fig)
        made.append(name)

    def band(ax, runs, key, label):
        xs, ys, sp = mean_curve(runs, key)
        if not xs:
            return
        n = sum(ok(s) for s in runs)
        (line,) = ax.plot(xs, ys, label=f"{label} (n={n})", lw=1.4, color=color(runs[0]["model"]))
        if n >= 2:
            ax.fill_between(xs, [y - s for y, s in zip(ys, sp)], [y + s for y, s in zip(ys, sp)],
                            color=line.get_color(), alpha=0.2, lw=0)

    main = {m: gs.get(f"{m}-{MAIN_CONTEXT}") for m in MODELS}
    for key, xlabel, name in (("step", "step", "bpb_vs_steps"), ("time_s", "training time (s)", "bpb_vs_time")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, g in main.items():
            if g:
                band(ax, g, key, MODELS[m][0])
        if key == "time_s" and t.get("equal_time"):
            for f in t["equal_time"]["fractions"]:
                ax.axvline(f * t["equal_time"]["t_ref"], color="grey", ls=":", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation bits per byte")
        ax.set_title(f"context {MAIN_CONTEXT}, equal tokens: mean ± spread over seeds"
                     + ("\n(dotted: the equal-time points)" if key == "time_s" and t.get("equal_time") else ""),
                     fontsize=10)
        _clip_y(ax, [s for g in main.values() if g for s in g])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        save(fig, f"{name}_{MAIN_CONTEXT}.png")
    eq = t.get("equal_time")
    if eq:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        fr = eq["fractions"]
        for i, (m, cells) in enumerate(eq["rows"].items()):
            pts = [(j + (i - len(eq["rows"]) / 2) * 0.03, cells[f]) for j, f in enumerate(fr) if cells[f]["n"]]
            if pts:
                ax.errorbar([x for x, _ in pts], [c["mean"] for _, c in pts],
                            yerr=[c["spread"] if c["n"] >= 2 else 0 for _, c in pts], marker="o", capsize=3,
                            label=MODELS[m][0], color=color(m))
                ended = [(x, c["mean"]) for x, c in pts if c["ended"]]
                if ended:  # hollow: some seeds had ended by then (their final value)
                    ax.plot([x for x, _ in ended], [y for _, y in ended], ls="none", marker="o", mfc="white",
                            mec=color(m), zorder=3)
        ax.set_xticks(range(len(fr)), [f"{f:g} x {MODELS[REFERENCE][0]}\n({f * eq['t_ref']:.0f} s)" for f in fr])
        ax.set_ylabel("validation bits per byte")
        ax.set_title(f"equal training time, context {eq['context']} (mean ± spread)\n"
                     "hollow: some seeds had ended earlier (their final value)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, f"equal_time_{MAIN_CONTEXT}.png")
    if "context" in t:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in CONTEXT_MODELS:
            cells = [(c, t["context"][m][c]["bpb"]) for c in CONTEXTS if t["context"][m][c].get("n_ok")]
            _errorbar(ax, cells, MODELS[m][0], color(m))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training context")
        ax.set_ylabel("bits per byte (final evaluation)")
        ax.set_title("context length (mean ± spread over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "context_bpb.png")
    if "chunk" in t:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _errorbar(ax, [(C, t["chunk"][C]["bpb"]) for C in CHUNK_SIZES if t["chunk"][C].get("n_ok")], "FLASH", color("flash"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk size C")
        ax.set_ylabel("bits per byte (final evaluation)")
        ax.set_title(f"chunk size, context {CHUNK_CONTEXT} (mean ± spread over seeds)", fontsize=10)
        ax.grid(alpha=0.3)
        save(fig, "chunk_size.png")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in MODELS:
        e = t["extrapolation"].get(f"{m}-{MAIN_CONTEXT}")
        if e:
            _errorbar(ax, [(k * MAIN_CONTEXT, e["bpb"][k]) for k in (1, 2, 4) if e["bpb"][k]["n"]], e["name"], color(m))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"evaluation context (trained at {MAIN_CONTEXT})")
    ax.set_ylabel("bits per byte")
    ax.set_title("length extrapolation (mean ± spread over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    save(fig, "extrapolation.png")
    return made


def color(model: str) -> str:
    """One colour per model in every plot."""
    return f"C{list(MODELS).index(model) % 10}"


def _errorbar(ax, cells: list[tuple[float, dict]], label: str, c: str) -> None:
    if cells:
        ax.errorbar([x for x, _ in cells], [s["mean"] for _, s in cells],
                    yerr=[s["spread"] if s["n"] >= 2 else 0 for _, s in cells], marker="o", capsize=3, label=label,
                    color=c)


def _clip_y(ax, runs: list[dict]) -> None:
    """Leave out the first evaluations' high values so that the differences at the end show."""
    curves = [s["curve"] for s in runs if ok(s) and s["curve"]]
    if curves:
        lo = min(c[-1]["bpb"] for c in curves)
        hi = max(c[min(1, len(c) - 1)]["bpb"] for c in curves)
        if hi > lo:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
