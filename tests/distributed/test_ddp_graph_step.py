"""The data-parallel CUDA-graph training step (``GraphedStep(data_parallel=env)``: forward + backward of the rank's
rows, the gradients summed over the ranks between two graphs, clipping + AdamW) against the trainer's eager DDP step,
on 2 gloo CPU processes: its body run eagerly (``capture=False``) gives the same per-step loss shares, gradient norms
(to the fp32 it reports them in) and final parameters (fp32 exact rule, documents packed anew every step, clipping that bites, a changing rate).  The capture
itself needs CUDA and NCCL (not in CI): what is captured is this body, two graphs around the all-reduce.

Both presets run in ONE launch of the 2 processes (``ddp_graph_vs_eager_presets``; a process start-up costs seconds on a
loaded CI machine), together with every other 2-process check of this folder (``launched_all`` of
tests/distributed/conftest.py); the test below checks each preset's piece."""

from __future__ import annotations

import pytest
from plan import DDP_GRAPH_PRESETS

from tolerances import assert_exact


@pytest.fixture(scope="module")
def launched(launched_all) -> dict:
    """``{preset: [rank 0's result, rank 1's]}`` of ``ddp_graph_vs_eager`` (chunk 8, 2 rows of 32, 3 steps), from the
    folder's one launch of the 2 processes (``launched_all`` of tests/distributed/conftest.py)."""
    return launched_all["ddp_graph"]


@pytest.mark.parametrize("preset", DDP_GRAPH_PRESETS)
def test_data_parallel_graph_step_equals_the_eager_ddp_step(launched, preset):
    outs = launched[preset]
    for rank, out in enumerate(outs):
        eager, graph = out["eager"], out["graph"]
        for i, (a, b) in enumerate(zip(eager["losses"], graph["losses"], strict=True)):
            assert a == pytest.approx(b, rel=1e-6), f"rank {rank} step {i} loss share"  # the step reports fp32
        for i, (a, b) in enumerate(zip(eager["norms"], graph["norms"], strict=True)):
            assert a == pytest.approx(b, rel=1e-6) and a > 0.05, f"rank {rank} step {i} gradient norm (clip active)"
        for name, p in eager["params"].items():
            assert_exact(f"rank {rank} {name}", p, graph["params"][name])
    # a capture that fails on one rank only makes every rank take eager steps (else their collectives would differ)
    assert [o["none_failed"] for o in outs] == [False, False] and [o["one_failed"] for o in outs] == [True, True]
    # the ranks held different rows, so their loss shares differ, and the update kept their models equal
    assert outs[0]["graph"]["losses"] != outs[1]["graph"]["losses"]
    for name, p in outs[0]["graph"]["params"].items():
        assert_exact(f"ranks agree: {name}", p, outs[1]["graph"]["params"][name])
