"""Token rows to expert-grouped rows and back, on one rank: the permutation every dispatcher does
around (or instead of) its exchange.

Legend: T tokens, K top-k, D hidden, E experts, N = T*K rows.

    rows_ND, counts_E, state = to_expert_rows(x_TD, topk_idx_TK, topk_w_TK, E, backend)
    y_TD = from_expert_rows(y_ND, state)       # router weights applied here, once
    src_N, w_N, counts_E = rows_plan(topk_idx_TK, topk_w_TK, E)   # the routing-only half

Backends (`moe.permute`): `torch` (a stable sort, a gather, a weighted `index_add_`) and `triton`
(`moevlm.kernels.permute`), the same rows in the same order.  Counts need no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PERMUTE_BACKENDS = ("torch", "triton")


@dataclass
class RowsState:
    num_tokens: int
    token_idx_N: torch.Tensor | None = None  # torch: source token of every row
    weight_N: torch.Tensor | None = None  # torch: router weight of every row
    plan: object = None  # triton, or padded rows: the kernels' PermutePlan
    topk_w_TK: torch.Tensor | None = None  # with plan
    backend: str = "triton"  # with plan: the permute kernels' backend


def sort_rows_by_expert(topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Order of the T*K flattened (token, choice) rows sorted by expert id, stable."""
    return torch.sort(topk_idx_TK.reshape(-1), stable=True).indices


def expert_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    flat = topk_idx_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def rows_plan(
    topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch backend's plan from routing alone: (source token of every row, its router weight, rows
    per expert), rows in the stable expert order."""
    order_N = sort_rows_by_expert(topk_idx_TK)
    return (
        order_N // topk_idx_TK.shape[1],
        topk_w_TK.reshape(-1)[order_N],
        expert_counts(topk_idx_TK, num_experts),
    )


def to_expert_rows(
    x_TD,
    topk_idx_TK,
    topk_w_TK,
    num_experts: int,
    backend: str = "torch",
    plan=None,
    pad_multiple: int = 1,
):
    """`plan`: `rows_plan(...)` already computed (torch backend), or None to compute it here.  `pad_multiple`
    > 1: every expert's rows padded with zero rows to a multiple of it (FP8 scale blocks; a host sync for the
    padded total), through `moevlm.kernels.permute` with either backend; the counts are then the padded ones."""
    if backend == "triton" or pad_multiple > 1:
        from moevlm.kernels.permute import permute, permute_plan

        plan = permute_plan(topk_idx_TK, num_experts, pad_multiple)
        return (
            permute(x_TD, plan, backend=backend),
            plan.rows_per_expert_E,
            RowsState(x_TD.shape[0], plan=plan, topk_w_TK=topk_w_TK, backend=backend),
        )
    if backend != "torch":
        raise ValueError(f"moe.permute={backend!r}; choose one of {list(PERMUTE_BACKENDS)}")
    token_idx_N, weight_N, counts_E = (
        plan if plan is not None else rows_plan(topk_idx_TK, topk_w_TK, num_experts)
    )
    return (
        x_TD[token_idx_N],
        counts_E,
        RowsState(x_TD.shape[0], token_idx_N=token_idx_N, weight_N=weight_N),
    )


def from_expert_rows(y_ND: torch.Tensor, state: RowsState) -> torch.Tensor:
    if state.plan is not None:
        from moevlm.kernels.permute import unpermute

        return unpermute(y_ND, state.plan, state.topk_w_TK.float(), backend=state.backend)
    return WeightedRowSum.apply(y_ND, state.weight_N, state.token_idx_N, state.num_tokens)


class WeightedRowSum(torch.autograd.Function):
    """y_TD[t] = sum over the rows n of token t, in row order, of w_N[n] y_ND[n] (`index_add_` into
    zeros).  The values and gradients are autograd's, op for op; what differs is what is kept for
    backward: y_ND and w_N, not the weighted rows (index_add's derivative keeps its source whole,
    for its shape alone)."""

    @staticmethod
    def forward(ctx, y_ND, weight_N, token_idx_N, num_tokens: int):
        w_N = weight_N.to(y_ND.dtype)
        ctx.weight_dtype = weight_N.dtype
        ctx.save_for_backward(y_ND, w_N, token_idx_N)
        weighted_ND = y_ND * w_N[:, None]
        return y_ND.new_zeros(num_tokens, y_ND.shape[1]).index_add_(0, token_idx_N, weighted_ND)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, w_N, token_idx_N = ctx.saved_tensors
        grad_ND = grad_TD.index_select(0, token_idx_N)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = grad_ND * w_N[:, None]
        if ctx.needs_input_grad[1]:  # the broadcast weight's gradient: summed over D, as autograd's
            grad_w = (grad_ND * y_ND).sum(1, keepdim=True).squeeze(1).to(ctx.weight_dtype)
        return grad_y, grad_w, None, None
