import os

import pytest
import torch

# without CUDA, Triton kernels run in its CPU interpreter (STYLE 17); set before any kernel module is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every ops test runs with NaN-poisoned fresh allocations."""
    yield
