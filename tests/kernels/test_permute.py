"""Permute / unpermute: the plan against a stable sort (hand-worked and random),
both backends against each other and against the local dispatcher (forward and
the x, y, topk_w gradients), the T=0 edge, opcheck, torch.compile and the
backend errors.  Triton runs under the interpreter (conftest).

Inputs are fresh every run: the seed is printed (shown with a failure) and
MOEVLM_TEST_SEED=<seed> replays it.
"""

import subprocess
import sys

import pytest
import torch
from moevlm.kernels import _common as common
from moevlm.kernels.permute import permute, permute_plan, unpermute

from moevlm.dispatch.local import LocalDispatcher

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# rtol / atol relative to the reference's largest entry.  vs_torch: the same fp32
# sums in another order, then one rounding.  vs_local: the local dispatcher scales
# and sums in the rows' own dtype (K roundings).
VS_TORCH = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
VS_LOCAL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


pytestmark = pytest.mark.usefixtures("seed")  # fresh inputs every run (tests/conftest.py)


def close(actual, expected, tol, seed, what):
    scale = float(expected.detach().float().abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        rtol=tol,
        atol=tol * max(scale, 1e-6),
        msg=lambda m: f"{what} (seed={seed}): {m}",
    )


def routing(T, K, E, empty=2):
    """Top-k indices with `empty` experts never chosen, and renormalized fp32 weights."""
    scores_TE = torch.randn(T, E)
    scores_TE[:, torch.randperm(E)[:empty]] = -torch.inf
    topk_w_TK, topk_idx_TK = scores_TE.softmax(-1).topk(K)
    return topk_idx_TK, topk_w_TK / topk_w_TK.sum(-1, keepdim=True)


# ---------------------------------------------------------------- the plan


def test_plan_hand_worked():
    # choices (t,k)->e: (0,0)->2 (0,1)->0 (1,0)->0 (1,1)->1 (2,0)->2 (2,1)->1; expert 3 empty.
    # Stable order: e0: (0,1) (1,0) | e1: (1,1) (2,1) | e2: (0,0) (2,0).
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])
    plan = permute_plan(idx, 4)
    assert plan.row_of_choice_TK.tolist() == [[4, 0], [1, 2], [5, 3]]
    assert plan.rows_per_expert_E.tolist() == plan.tokens_per_expert_E.tolist() == [2, 2, 2, 0]
    assert plan.num_rows == 6
    # Padded to 4: blocks start at 0, 4, 8, 12; the real rows come first in each.
    plan = permute_plan(idx, 4, pad_multiple=4)
    assert plan.row_of_choice_TK.tolist() == [[8, 0], [1, 4], [9, 5]]
    assert plan.rows_per_expert_E.tolist() == [4, 4, 4, 0]
    assert plan.tokens_per_expert_E.tolist() == [2, 2, 2, 0]
    assert plan.num_rows == 12


@pytest.mark.parametrize("pad", [1, 3, 16])
def test_plan_is_stable_sort_by_expert(pad, seed):
    T, K, E = 97, 4, 12
    idx, _ = routing(T, K, E, empty=3)
    plan = permute_plan(idx, E, pad_multiple=pad)
    flat = idx.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + pad - 1) // pad * pad
    starts = padded.cumsum(0) - padded
    expected = torch.empty_like(flat)
    for e in range(E):  # expert e's choices, in token order, fill the start of its block
        expected[flat == e] = starts[e] + torch.arange(int(counts[e]))
    assert torch.equal(plan.row_of_choice_TK.reshape(-1), expected), f"seed={seed}"
    assert torch.equal(plan.tokens_per_expert_E, counts) and torch.equal(
        plan.rows_per_expert_E, padded
    )
    assert plan.num_rows == int(padded.sum())
    if pad == 1:  # exactly the inverse of the local dispatcher's stable sort
        order = torch.sort(flat, stable=True).indices
        assert torch.equal(plan.row_of_choice_TK.reshape(-1)[order], torch.arange(T * K))


def test_plan_refuses_expert_out_of_range():
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match="out of bounds"):
            permute_plan(torch.tensor([[bad, 0]]), 4)


# ---------------------------------------------------------------- forward and gradients


def run(backend, x, y, w, plan, g1, g2):
    x, y, w = (t.detach().requires_grad_() for t in (x, y, w))
    out1, out2 = permute(x, plan, backend), unpermute(y, plan, w, backend)
    ((out1.float() * g1).sum() + (out2.float() * g2).sum()).backward()
    return out1, out2, x.grad, y.grad, w.grad


def run_local(x, y, w, idx, plan, g1, g2):
    """The same loss through LocalDispatcher, its rows placed at the plan's real rows."""
    x, y, w = (t.detach().requires_grad_() for t in (x, y, w))
    K = idx.shape[1]
    x_MD, counts_E, handle = LocalDispatcher(len(plan.tokens_per_expert_E), K).dispatch(x, idx, w)
    assert torch.equal(counts_E, plan.tokens_per_expert_E)
    real_rows = plan.row_of_choice_TK.reshape(-1)[torch.sort(idx.reshape(-1), stable=True).indices]
    out1 = x.new_zeros(plan.num_rows, x.shape[1]).index_copy(0, real_rows, x_MD)
    out2 = LocalDispatcher(len(counts_E), K).combine(y[real_rows], handle)
    ((out1.float() * g1).sum() + (out2.float() * g2).sum()).backward()
    return out1, out2, x.grad, y.grad, w.grad


NAMES = ("permute", "unpermute", "dx", "dy", "dw")


# fp32 in the fast tier, the 2-byte types in the slow one
@pytest.mark.parametrize(
    "dtype", [DTYPES[0], *(pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:])], ids=str
)
@pytest.mark.parametrize("K,E", [(1, 4), (8, 16)])
@pytest.mark.parametrize("pad", [1, 8])
def test_backends_and_local_dispatcher_agree(dtype, K, E, pad, seed):
    T, D = 70, 300  # tails in both tile dimensions (16 x 256 tiles)
    idx, w = routing(T, K, E)
    plan = permute_plan(idx, E, pad_multiple=pad)
    x = torch.randn(T, D).to(dtype)
    # padding rows hold noise: unpermute must ignore them
    y = torch.randn(plan.num_rows, D).to(dtype)
    g1, g2 = torch.randn(plan.num_rows, D), torch.randn(T, D)
    tri = run("triton", x, y, w, plan, g1, g2)
    ref = run("torch", x, y, w, plan, g1, g2)
    loc = run_local(x, y, w, idx, plan, g1, g2)
    for name, a, r, lo in zip(NAMES, tri, ref, loc):
        assert a.dtype == r.dtype == lo.dtype, name
        close(a, r, VS_TORCH[dtype], seed, f"{name} triton vs torch")
        close(r, lo, VS_LOCAL[dtype], seed, f"{name} torch vs local")
        close(a, lo, VS_LOCAL[dtype], seed, f"{name} triton vs local")
    if pad > 1:
        padding = torch.ones(plan.num_rows, dtype=torch.bool)
        padding[plan.row_of_choice_TK.reshape(-1)] = False
        assert padding.sum() == plan.num_rows - T * K > 0
        for out in (tri, ref):
            assert not out[0][padding].any() and not out[3][padding].any(), (
                f"padding not zero (seed={seed})"
            )


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pad", [1, 8])
def test_no_tokens(backend, pad):
    idx, w = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    plan = permute_plan(idx, 4, pad_multiple=pad)
    assert plan.num_rows == 0 and plan.rows_per_expert_E.tolist() == [0, 0, 0, 0]
    x, y = torch.zeros(0, 8), torch.zeros(0, 8)
    out1, out2, dx, dy, dw = run(backend, x, y, w, plan, torch.zeros(0, 8), torch.zeros(0, 8))
    assert out1.shape == out2.shape == dx.shape == dy.shape == (0, 8) and dw.shape == (0, 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weights_without_grad_and_expanded_grad(backend, seed):
    """topk_w not requiring grad skips d w; an expanded incoming gradient needs no copy."""
    idx, w = routing(40, 2, 6)
    plan = permute_plan(idx, 6, pad_multiple=4)
    y = torch.randn(plan.num_rows, 48, requires_grad=True)
    unpermute(y, plan, w, backend).sum().backward()  # d out is an expanded (stride 0) tensor
    expected = torch.zeros_like(y)
    expected[plan.row_of_choice_TK] = w[:, :, None].expand(-1, -1, 48)
    close(y.grad, expected, 1e-6, seed, "dy")


# ---------------------------------------------------------------- custom ops


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    """Schema, fake, autograd registration and AOT dispatch (dynamic) of all four ops;
    the Triton kernels run under the interpreter, so they can be checked here too."""
    idx, w = routing(12, 2, 4)
    plan = permute_plan(idx, 4, pad_multiple=4)
    x, y = (
        torch.randn(12, 40, requires_grad=True),
        torch.randn(plan.num_rows, 40, requires_grad=True),
    )
    row, rows_E, tokens_E = plan.row_of_choice_TK, plan.rows_per_expert_E, plan.tokens_per_expert_E
    ops = torch.ops.moevlm
    torch.library.opcheck(ops.permute.default, (x, row, rows_E, tokens_E, plan.num_rows, backend))
    torch.library.opcheck(
        ops.unpermute.default, (y, row, w.requires_grad_(), rows_E, tokens_E, backend)
    )
    torch.library.opcheck(ops.permute_backward.default, (y.detach(), row, backend))
    for need_dw in (True, False):
        torch.library.opcheck(
            ops.unpermute_backward.default,
            (x.detach(), y.detach(), row, w.detach(), rows_E, tokens_E, need_dw, backend),
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_traces_both_ops(backend, seed):
    idx, w = routing(24, 2, 4)
    plan = permute_plan(idx, 4)
    x = torch.randn(24, 32)

    def step(x, w):
        return (unpermute(permute(x, plan, backend).sin(), plan, w, backend) ** 2).sum()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xg, wg)
        loss.backward()
        results.append((loss.detach(), xg.grad, wg.grad))
    for name, a, b in zip(("loss", "dx", "dw"), *results):
        close(a, b, 1e-5, seed, name)


# ---------------------------------------------------------------- errors


def test_unknown_backend_is_named():
    plan = permute_plan(torch.tensor([[0]]), 1)
    with pytest.raises(ValueError, match="'cutlass'"):
        permute(torch.zeros(1, 4), plan, "cutlass")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setattr(common, "INTERPRET", False)  # as if imported without TRITON_INTERPRET=1
    plan = permute_plan(torch.tensor([[0]]), 1)
    with pytest.raises(ValueError, match="CUDA tensors"):
        permute(torch.zeros(1, 4), plan, "triton")


def test_missing_triton_is_named(monkeypatch):
    monkeypatch.setattr(common, "triton", None)  # as if triton were not installed
    plan = permute_plan(torch.tensor([[0]]), 1)
    with pytest.raises(ImportError, match="`triton` package"):
        permute(torch.zeros(1, 4), plan, "triton")


def test_imports_and_runs_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, moevlm.kernels.permute as P\n"
        "plan = P.permute_plan(torch.tensor([[1, 0]]), 2)\n"
        "assert P.permute(torch.ones(1, 3), plan).shape == (2, 3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
