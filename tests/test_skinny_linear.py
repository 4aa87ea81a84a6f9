"""The compiled skinny fp32 GEMM (speculative decoding's verification rows): F.linear's result,
and each row's result independent of the rows sharing the call."""

from __future__ import annotations

import pytest
import torch

from tokenloom.model.kernels import cpu_kernels

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable")


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("k", [576, 61])  # a multiple of 8, and one with a scalar tail
def test_matches_linear_and_is_row_invariant(rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(300, k, generator=g), torch.randn(300, generator=g)
    out = torch.empty(rows, 300)
    kernels.skinny_linear(out, x, w, b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    one = torch.empty(1, 300)
    kernels.skinny_linear(one, x[-1:].contiguous(), w, None)
    assert torch.equal(one[0] + b, out[-1])  # same dot product order for any row count


def test_refuses_other_dtypes():
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.skinny_linear(torch.empty(2, 3), torch.randn(2, 4).bfloat16(), torch.randn(3, 4), None)
