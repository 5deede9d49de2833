"""``lintime presets``: every named model preset with its family, shape and parameter count."""

from __future__ import annotations

from lintime.cli import command


@command
def presets(family: str = "", markdown: bool = False) -> None:
    """List the model presets with their parameter counts (counted on the meta device: no memory used).

    Args:
        family: only presets of this family (e.g. flash, gla, vq); empty for all.
        markdown: print a Markdown table (as in docs/models.md).
    """
    import torch

    from lintime.models import CausalLM, all_presets, available_families

    if family and family not in available_families():
        raise ValueError(f"unknown family {family!r}; available: {', '.join(available_families())}")
    rows = []
    for name, cfg in all_presets().items():
        if family and cfg.family != family:
            continue
        with torch.device("meta"):
            model = CausalLM(cfg)
        rows.append((name, cfg.family, cfg.d_model, cfg.n_layers, cfg.vocab_size, model.num_parameters()))
    if markdown:
        print("| preset | family | d_model | layers | vocab | parameters |")
        print("|---|---|---:|---:|---:|---:|")
        for n, f, d, l, v, p in rows:
            print(f"| `{n}` | `{f}` | {d} | {l} | {v} | {p:,} |")
        return
    print(f"{'preset':28s} {'family':10s} {'d_model':>7s} {'layers':>6s} {'vocab':>6s} {'parameters':>14s}")
    for n, f, d, l, v, p in rows:
        print(f"{n:28s} {f:10s} {d:7d} {l:6d} {v:6d} {p:14,d}")
