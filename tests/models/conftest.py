import pytest
import torch

# ``with torch.device("meta")`` (used to count the parameters of seed-scale models without
# allocating them) recognises tensor constructors from a set that torch builds once per process,
# on first use.  Built while ``poison_empty`` has replaced ``torch.empty`` by its wrapper, the set
# would miss the real ``torch.empty`` and "meta" models would be allocated for real.  Build it
# here, at collection time, before any fixture patches ``torch.empty``.
with torch.device("meta"):
    torch.empty(0)


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Model tests also run with NaN-poisoned fresh allocations: a cache or state that reads
    memory it never wrote fails the comparisons."""
    yield


