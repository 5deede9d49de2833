"""A small code corpus, prepared once, for the distributed training tests."""

from __future__ import annotations

import random

import pytest

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

