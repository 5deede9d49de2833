"""Fixtures for the training tests: a small synthetic code corpus, prepared once per session,
and a tiny training config (transformer-pp-tiny, 4 rows of 32 tokens per step)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lintime.data import prepare
from lintime.training import TrainConfig

N_FILES = 120  # enough that the 5 % validation split of the hash rule is not empty


def write_code_corpus(root: Path, n_files: int = N_FILES, seed: int = 0) -> Path:
    """``n_files`` small Python-like files (learnable: the loss falls within a few steps)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total", "name", "result"]
    for i in range(n_files):
        lines = []
        for j in range(rng.randint(3, 8)):
            a, b = rng.choice(words), rng.choice(words)
            lines.append(f"def {a}_{j}({b}):\n    return {b} + {rng.randint(0, 9)}\n")
        path = root / f"mod{i % 4}" / f"file{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines), encoding="utf-8")
    return root



@pytest.fixture(scope="session")
def code_corpus(tmp_path_factory) -> Path:
    return write_code_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory, code_corpus) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    splits = prepare(code_corpus, "byte", cache, splits=("train", "validation"), quiet=True)
    assert splits["validation"].n_docs > 0
    return cache


@pytest.fixture
def tiny_config(code_corpus, token_cache):
    """``tiny_config(**overrides)``: a TrainConfig that trains in well under a second per step."""

    def make(**overrides) -> TrainConfig:
        base = dict(
            preset="transformer-pp-tiny", corpus=str(code_corpus), cache_dir=str(token_cache),
            context_len=32, tokens_per_batch=128, steps=6, log_every=1, eval_every=0, eval_tokens=256,
            save_every=0, keep=0, plots=False, sample_tokens=8, device="cpu",
        )
        base.update(overrides)
        return TrainConfig(**base)

    return make
