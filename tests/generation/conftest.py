"""The generation and evaluation tests run many small ops, where handing work to a second thread
costs more than it saves (and on a busy machine much more): run them single-threaded."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
