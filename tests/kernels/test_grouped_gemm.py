"""Grouped GEMM backends against the per-expert loop reference, forward and both
gradients, with uneven and empty groups."""

import pytest
import torch

from moevlm.kernels import grouped_mm


@pytest.mark.parametrize("counts", [[5, 0, 3, 8], [0, 0, 16, 0], [1, 2, 3, 10]])
def test_torch_grouped_mm_matches_loop(counts):
    counts_E = torch.tensor(counts)
    x = torch.randn(int(counts_E.sum()), 32, requires_grad=True)
    w = torch.randn(len(counts), 32, 24, requires_grad=True)
    outs, grads = [], []
    for backend in ("loop", "torch"):
        y = grouped_mm(x, w, counts_E, backend)
        # not a view: FSDP2 warns when a wrapped module (the experts) returns one
        assert y._base is None
        y.sum().backward()  # an expanded (non-contiguous) incoming gradient on purpose
        outs.append(y.detach())
        grads.append((x.grad.clone(), w.grad.clone()))
        x.grad, w.grad = None, None
    torch.testing.assert_close(outs[1], outs[0])
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b)
    empty = [e for e, c in enumerate(counts) if c == 0]
    assert all(float(grads[1][1][e].abs().max()) == 0 for e in empty)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'cutlass'"):
        grouped_mm(torch.zeros(1, 4), torch.zeros(1, 4, 4), torch.tensor([1]), "cutlass")
