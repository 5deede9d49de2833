"""HF integration tests: single-threaded (tiny ops), offline, and with HF's caches in a temporary
folder so nothing is written to the user's home."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # hf_helpers



@pytest.fixture(autouse=True, scope="session")
def _offline(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_home")
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(root / "modules"), "HF_HOME": str(root / "home")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
