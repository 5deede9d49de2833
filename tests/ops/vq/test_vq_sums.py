"""The layer's EMA codebook statistics (lintime/ops/vq/sums.py code_sums) against the one-hot definition
(seed Section 3.4.1): per-code counts and key sums, fp32 for fp32 / bf16 keys."""

import pytest
import torch

from lintime.ops.vq.sums import code_sums
from tolerances import assert_exact

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_code_sums_equal_the_one_hot_definition(dtype):
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 9, (53,), generator=g).to(DEV)
    x = torch.randn(53, 21, generator=g).to(dtype).to(DEV)
    n, s = code_sums(rows, x, 9)
    onehot = torch.nn.functional.one_hot(rows, 9).double()  # [M, 9]
    assert n.dtype == s.dtype == torch.float32 and n.shape == (9,) and s.shape == (9, 21)
    assert torch.equal(n.double(), onehot.sum(0))
    assert_exact("sums vs one-hot", onehot.T @ x.double(), s)
