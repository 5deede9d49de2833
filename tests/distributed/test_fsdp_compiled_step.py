"""The FSDP2 training step with its blocks compiled (``compile_blocks``: what ``--compile model`` takes under
``--parallel fsdp``) against the eager FSDP2 step, on 2 gloo
CPU processes, over 3 steps of documents packed anew every step, accumulation over two micro-batches, clipping that
bites, AdamW on the local shards at a changing rate, and a validation forward (eval mode, no gradient, then
``reshard``) between steps 2 and 3: the same loss shares, gradient norms and validation logits, every parameter's
gradient at every step (fp32 exact rule, tests/tolerances.py, ``assert_exact_grad`` for the 0-D scale), and the same
final model.

The final parameters are compared as one vector, not one by one: AdamW's normalised update turns a gradient that is
zero up to rounding (the key bias's: softmax does not see it) into a step of the learning rate's size in both runs,
so a zero-initialised key bias holds rounding noise scaled up (5.8e-6 relative here); the gradients it came from are
compared above.

``torch.compile``'s backend is ``aot_eager`` (dynamo's graphs, split into forward and backward by AOT autograd --
which saves the gathered parameters that FSDP2 frees after a unit's forward and gathers again before its backward --,
run as PyTorch ops): inductor's code generation is not what is tested, and takes minutes on a CI machine's CPU.  The
preset is transformer-pp-tiny, whose blocks trace as one graph each on the CPU (packed softmax attention is one SDPA
call); FLASH's packed chunk layout is read on the host on the CPU (its graph breaks: tests/training/
test_compiled_model.py compiles its blocks, on CUDA its ops are opaque custom ops).

Slow: dynamo's tracing of the two blocks (train and validation graphs) takes seconds on a
2-core machine.  Not tested here: the speed (no GPU), inductor's kernels, NCCL.
"""

from __future__ import annotations

import pytest
import torch

from tolerances import assert_exact, assert_exact_grad


@pytest.fixture(scope="module")
def launched(launched_all) -> list[dict]:
    """``[rank 0's result, rank 1's]`` of ``fsdp_compiled_vs_eager`` (``FSDP_COMPILED_JOB`` of
    tests/distributed/plan.py: transformer-pp-tiny, chunk 8, 2 rows of 32 per rank, 3 steps), from the folder's one
    launch of the 2 processes (``launched_all`` of tests/distributed/conftest.py)."""
    return launched_all["fsdp_compiled"]


def _flat(params: dict) -> torch.Tensor:
    return torch.cat([p.flatten() for p in params.values()])


@pytest.mark.slow
def test_compiled_fsdp_step_equals_the_eager_fsdp_step(launched):
    for rank, out in enumerate(launched):
        eager, compiled = out["eager"], out["compiled"]
        assert_exact(f"rank {rank} loss shares", eager["losses"], compiled["losses"])
        assert_exact(f"rank {rank} gradient norms", eager["norms"], compiled["norms"])
        assert (eager["norms"] > 0.05).all(), "the clip must bite"
        assert_exact(f"rank {rank} validation logits", eager["val"], compiled["val"])
        for step, (ref, got) in enumerate(zip(eager["grads"], compiled["grads"], strict=True)):
            assert ref.keys() == got.keys()
            for name, g in ref.items():
                assert_exact_grad(f"rank {rank} step {step} d{name}", g, got[name])
        assert_exact(f"rank {rank} final parameters", _flat(eager["params"]), _flat(compiled["params"]))
        # compiled for real, each block as one graph: a graph for the first block and one for the other (its
        # residual branch comes in), train and validation
        assert compiled["fullgraph"] == [True, True] and compiled["lines"] == []
        assert eager["graphs"] == 0 and compiled["graphs"] >= 2, (eager["graphs"], compiled["graphs"])
    # the ranks held different rows, and the sharded update kept one model
    assert not torch.equal(launched[0]["compiled"]["losses"], launched[1]["compiled"]["losses"])
    assert torch.equal(_flat(launched[0]["compiled"]["params"]), _flat(launched[1]["compiled"]["params"]))
