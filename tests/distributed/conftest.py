"""A small code corpus, prepared once, for the distributed training tests; the one launch of the graph-step checks
(tests/distributed/test_ddp_graph_step.py and test_fsdp_compiled_step.py)."""

from __future__ import annotations

import random

import pytest
from launch import run_ranks
from workers import graph_steps

from lintime.data import prepare


@pytest.fixture(scope="session")
def dist_corpus(tmp_path_factory) -> tuple[str, str]:
    """``(corpus folder, token cache folder)``: 120 small Python-like files, byte tokenizer."""
    root = tmp_path_factory.mktemp("dist_corpus")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total"]
    for i in range(120):
        body = "".join(f"def {rng.choice(words)}_{j}(x):\n    return x + {rng.randint(0, 9)}\n" for j in range(rng.randint(2, 6)))
        path = root / f"m{i % 3}" / f"f{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    cache = tmp_path_factory.mktemp("dist_cache")
    prepare(root, "byte", cache, splits=("train", "validation"), quiet=True)
    return str(root), str(cache)



# what the graph-step tests run: test_fsdp_compiled_step.py (preset, chunk, rows per rank, T, steps) and
# test_ddp_graph_step.py (presets, chunk, rows per rank, T, steps)
FSDP_COMPILED_JOB = ("transformer-pp-tiny", 8, 2, 32, 3)
DDP_GRAPH_PRESETS = ("flash-tiny", "gla-tiny")


@pytest.fixture(scope="session")
def graph_steps_launched() -> dict:
    """Both graph-step checks on the same 2 gloo processes (a launch's start-up costs seconds on a loaded CI
    machine): ``{"fsdp": [rank 0's fsdp_compiled_vs_eager result, rank 1's], "ddp": {preset: [rank 0's
    ddp_graph_vs_eager result, rank 1's]}}``."""
    outs = run_ranks(graph_steps, 2, [FSDP_COMPILED_JOB], (DDP_GRAPH_PRESETS, 8, 2, 32, 3), timeout=400)
    return {"fsdp": [out["fsdp"][0] for out in outs],
            "ddp": {preset: [out["ddp"][i] for out in outs] for i, preset in enumerate(DDP_GRAPH_PRESETS)}}
