"""The CPU sampler's greedy pick (raylora_kernels/csrc/sample_cpu.cpp) against torch.argmax."""

import pytest
import torch


@pytest.mark.timeout(60)
def test_argmax_rows_matches_torch():
    """csrc/sample_cpu.cpp's greedy pick against torch.argmax: ties (the first wins, within a
    lane and across lanes), NaN (torch counts it as the largest: its first one), infinities,
    all -inf rows, widths that are not a multiple of 16, strided rows."""
    from raylora_kernels.cpu_kernel import cpu_argmax_op

    op = cpu_argmax_op()
    if op is None:
        pytest.skip("the C++ CPU kernels are not built on this machine")
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 16, 33, 1000, 49152):
        x = torch.randn(12, vocab, generator=g)
        x[1] = 3.0  # all equal: index 0
        x[2, vocab // 2 :] = 50.0  # a tie across lanes and positions
        x[3, -1] = float("inf")
        x[4] = float("-inf")
        x[5, vocab // 3] = float("nan")
        x[5, -1] = float("nan")
        x[6, 0] = float("-inf")
        x[7, vocab // 2] = float("inf")
        x[7, -1] = float("-inf")
        assert torch.equal(op(x), x.argmax(dim=-1)), vocab
        wide = torch.randn(4, vocab + 5, generator=g)[:, :vocab]  # rows not contiguous together
        assert torch.equal(op(wide), wide.argmax(dim=-1))
