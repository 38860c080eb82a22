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


def test_torch_grouped_mm_takes_autocast_dtype_on_a_cuda_device():
    """torch._grouped_mm is on no autocast list and its CUDA kernel takes bf16 only: fp32 master weights
    under bf16 autocast (a one-GPU run without FSDP) were refused.  Checked on fake CUDA tensors, whose
    shape rules are the CUDA kernel's (the meta function); and on the CPU for the values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda = torch.device("cuda", 0)
    with FakeTensorMode(), torch.no_grad():
        x, w = torch.randn(16, 32, device=cuda), torch.randn(4, 32, 24, device=cuda)
        counts = torch.tensor([4, 4, 0, 8], device=cuda)
        with pytest.raises(RuntimeError, match="BF16"):  # what the GPU said without the cast
            torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
        torch.set_autocast_enabled("cuda", True)  # torch.autocast refuses a build without CUDA
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            y = grouped_mm(x, w, counts, "torch")
        finally:
            torch.set_autocast_enabled("cuda", False)
        assert y.dtype == torch.bfloat16 and y.device == cuda and y.shape == (16, 24)
    counts = torch.tensor([5, 0, 3, 8])
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(4, 32, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, counts, "torch")
    ref = grouped_mm(x.detach().bfloat16(), w.detach().bfloat16(), counts, "loop")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float())
    y.float().sum().backward()  # the gradients reach the fp32 leaves in fp32
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
