"""A small code corpus, prepared once, for the distributed training tests, their training settings, and the one
launch of the 2 processes that every 2-process check of this folder reads (tests/distributed/plan.py)."""

from __future__ import annotations

import random

import pytest
from plan import base_config, launch_all

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




@pytest.fixture(scope="session")
def base(dist_corpus) -> dict:
    """The training runs' settings (tests/distributed/plan.py ``base_config``)."""
    return base_config(*dist_corpus)


@pytest.fixture(scope="session")
def launched_all(base, tmp_path_factory) -> dict:
    """Every 2-process check of test_distributed.py, test_ddp_graph_step.py and test_fsdp_compiled_step.py from one
    launch of the 2 gloo processes, with the single-process references and resumes (``plan.launch_all``)."""
    return launch_all(base, tmp_path_factory.mktemp("dist_runs"))
