import pytest


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every ops test runs with NaN-poisoned fresh allocations."""
    yield
