"""Autograd functions that keep less for backward (RMSNorm, the weighted row sum of a combine, the
grouped GEMM of a cast weight) give autograd's own values and gradients, bit for bit,
and keep fewer bytes between forward and backward than the plain ops do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moevlm.kernels.grouped_gemm import grouped_mm
from moevlm.model.decoder import RMSNorm
from moevlm.model.rows import RowsState, from_expert_rows
from moevlm.parallel.recompute import SavedBytes

DTYPES = [torch.float32, torch.bfloat16]


def _grads(fn, *inputs, seed=1):
    """fn(*inputs), and the gradients of a random projection of it w.r.t. the inputs."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _saved_bytes(fn, *inputs, params=()) -> int:
    """Bytes fn keeps for backward; the inputs at `params` are parameters (alive anyway: not counted)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    holder = torch.nn.Module()
    for i in params:
        holder.register_parameter(f"p{i}", torch.nn.Parameter(leaves[i]))
    with SavedBytes(holder) as meter:
        out = fn(*leaves)
        n = meter.bytes
    del out
    return n


def _same(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    assert out_a.dtype == out_b.dtype and torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b)
    for x, y in zip(grads_a, grads_b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _rmsnorm_autograd(x, weight, eps=1e-6):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 48), (2, 5, 3, 16)])
def test_rmsnorm_equals_autograd_and_keeps_less(x_dtype, w_dtype, shape):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape)).to(x_dtype).requires_grad_()
    w = (1 + torch.randn(shape[-1]) / 4).to(w_dtype).requires_grad_()

    def ours(x, w):
        return _with_weight(w)(x)

    _same(_grads(_rmsnorm_autograd, x, w), _grads(ours, x, w))
    if x_dtype == torch.bfloat16:
        assert _saved_bytes(ours, x, w) < _saved_bytes(_rmsnorm_autograd, x, w) / 2


def _with_weight(w) -> RMSNorm:
    """An RMSNorm whose weight is the tensor `w` (a leaf of the test's graph, not a parameter)."""
    norm = RMSNorm(w.shape[0], eps=1e-6)
    del norm.weight
    norm.weight = w
    return norm


def _combine_autograd(y_ND, w_N, token_idx_N, T):
    weighted_ND = y_ND * w_N.to(y_ND.dtype)[:, None]
    return y_ND.new_zeros(T, y_ND.shape[1]).index_add_(0, token_idx_N, weighted_ND)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_row_sum_equals_autograd_and_keeps_less(dtype):
    torch.manual_seed(0)
    T, K, D = 19, 4, 32
    token_idx_N = torch.argsort(torch.randint(0, 8, (T * K,)), stable=True) // K
    y = torch.randn(T * K, D).to(dtype).requires_grad_()
    w = torch.rand(T * K).requires_grad_()  # router weights: fp32

    def ours(y, w):
        return from_expert_rows(y, RowsState(T, token_idx_N=token_idx_N, weight_N=w))

    def theirs(y, w):
        return _combine_autograd(y, w, token_idx_N, T)

    _same(_grads(theirs, y, w), _grads(ours, y, w))
    assert _saved_bytes(ours, y, w) < _saved_bytes(theirs, y, w)


def _grouped_mm_autograd(x, w, counts):
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    out = torch._grouped_mm(x, w, offs=counts.cumsum(0, dtype=torch.int32))
    out.register_hook(lambda g: g.contiguous())
    return out


def test_grouped_mm_of_a_cast_weight_equals_autograd_and_keeps_less():
    torch.manual_seed(0)
    counts = torch.tensor([16, 0, 24, 8])
    x = torch.randn(48, 32).to(torch.bfloat16).requires_grad_()
    w = torch.randn(4, 32, 16).requires_grad_()  # fp32 master weights under bf16 autocast

    def ours(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grouped_mm(x, w, counts, backend="torch")

    def theirs(x, w):
        return _grouped_mm_autograd(x, w, counts)

    _same(_grads(theirs, x, w), _grads(ours, x, w))
    # the bf16 copy of the weight is not kept (the weight itself is a parameter: not counted)
    assert _saved_bytes(ours, x, w, params=[1]) < _saved_bytes(theirs, x, w, params=[1])
