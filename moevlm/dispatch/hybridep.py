"""The `hybridep` dispatcher: `deep_ep.HybridEPBuffer` (DeepEP's hybrid-ep branch) behind our
interface.  Why, and its capacity mode: docs/dispatchers.md.

Legend as in `base.py`, plus P ranks in the EP group, L = E / P experts per rank, T' the token count
every rank hands HybridEP (T padded: equal on all ranks, a multiple of TOKEN_ALIGN), M permuted rows
on this rank (HybridEP's, already grouped by local expert).

    dispatch: dense_routing(topk) -> (T, E) bool map + (T, E) fp32 probs, padded to T' rows
              -> moevlm_hybridep::dispatch: buffer.dispatch_with_permute -> M rows grouped by local
                 expert, one fp32 router weight per row, rows per local expert, overflow flag
    combine:  rows scaled by their router weight -> moevlm_hybridep::combine:
              buffer.combine_with_unpermute (HybridEP's sum is unweighted) -> the first T rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from moevlm.dispatch.alltoall import _check_capacity, _resolve_group
from moevlm.dispatch.base import (
    TokenDispatcher,
    dense_routing,
    register_dispatcher,
    token_bound,
)
from moevlm.dispatch.capacity import add_overflow, expert_capacity, in_backward
from moevlm.dispatch.handles import lookup, register_combine_autograd, store

WIRE_DTYPE = torch.bfloat16  # HybridEP moves and reduces 2-byte rows only
# T' is a multiple of this (HybridEP's per-chunk alignment; Megatron pads the same)
TOKEN_ALIGN = 64
# EP group name -> (buffer, (hidden, L))
_BUFFERS: dict[str, tuple[object, tuple[int, int]]] = {}


def _buffer(group, hidden: int, max_tokens: int, num_local_experts: int, num_sms: int = 0):
    """The group's HybridEPBuffer for (hidden, L), built here for `max_tokens` at first; a larger token count
    later is HybridEP's to grow into, so only a wider hidden or another L builds a new one."""
    from deep_ep import HybridEPBuffer

    have = _BUFFERS.get(group.group_name)
    if have is not None and have[1][0] >= hidden and have[1][1] == num_local_experts:
        return have[0]
    sms = {"num_sms_dispatch_api": num_sms, "num_sms_combine_api": num_sms} if num_sms else {}
    buffer = HybridEPBuffer(
        group=group,
        hidden_dim=hidden,
        max_num_of_tokens_per_rank=max_tokens,
        num_local_experts=num_local_experts,
        **sms,
    )
    _BUFFERS[group.group_name] = (buffer, (hidden, num_local_experts))
    return buffer


# ----------------------------------------------------------------- the exchanges as custom ops
@torch.library.custom_op("moevlm_hybridep::dispatch", mutates_args=())
def hybridep_dispatch(
    x: Tensor,
    routing_map: Tensor,
    probs: Tensor,
    group_name: str,
    num_local_experts: int,
    num_permuted_tokens: int,
    pad_multiple: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """buffer.dispatch_with_permute -> (rows_MD grouped by local expert, router weight per row (fp32), rows per
    local expert (int64, x's device), overflow flag (int32, 1 element), handle id).  `num_permuted_tokens` < 0:
    HybridEP sizes M itself (a host sync)."""
    buffer = _BUFFERS[group_name][0]
    budget = None if num_permuted_tokens < 0 else num_permuted_tokens
    pad = pad_multiple if pad_multiple > 1 else None
    rows, row_probs, _, per_expert, handle = buffer.dispatch_with_permute(
        hidden=x,
        routing_map=routing_map,
        probs=probs,
        num_of_experts_per_rank=num_local_experts,
        num_permuted_tokens=budget,
        pad_multiple=pad,
        non_blocking=budget is not None,
    )
    flag = handle[-1].reshape(1).to(device=x.device, dtype=torch.int32, copy=True)
    return (
        rows,
        row_probs.float(),
        per_expert.to(device=x.device, dtype=torch.int64, copy=True),
        flag,
        store(buffer, handle, pad),
    )


@hybridep_dispatch.register_fake
def _(x, routing_map, probs, group_name, num_local_experts, num_permuted_tokens, pad_multiple):
    M = (
        num_permuted_tokens
        if num_permuted_tokens >= 0
        else torch.library.get_ctx().new_dynamic_size()
    )
    return (
        x.new_empty(M, x.shape[1]),
        probs.new_empty(M),
        x.new_empty(num_local_experts, dtype=torch.int64),
        x.new_empty(1, dtype=torch.int32),
        torch.empty(1, dtype=torch.int64),
    )


@torch.library.custom_op("moevlm_hybridep::combine", mutates_args=())
def hybridep_combine(y: Tensor, handle_id: Tensor, num_tokens: int) -> Tensor:
    """buffer.combine_with_unpermute: the unweighted sum, per source token, of its rows on every rank."""
    buffer, handle, pad = lookup(handle_id)
    return buffer.combine_with_unpermute(hidden=y, handle=handle, pad_multiple=pad)[0]


@hybridep_combine.register_fake
def _(y, handle_id, num_tokens):
    return y.new_empty(num_tokens, y.shape[1])


@torch.library.custom_op("moevlm_hybridep::dispatch_backward", mutates_args=())
def hybridep_dispatch_backward(
    grad_rows: Tensor, grad_probs: Tensor, handle_id: Tensor, num_tokens: int, num_experts: int
) -> tuple[Tensor, Tensor]:
    """dispatch's backward: combine_with_unpermute of the row and per-row weight gradients -> (T', D), and
    the dense (T', E) probs gradient."""
    buffer, handle, pad = lookup(handle_id)
    gx, gprobs = buffer.combine_with_unpermute(
        hidden=grad_rows.contiguous(),
        probs=grad_probs.contiguous(),
        handle=handle,
        pad_multiple=pad,
    )
    return gx, gprobs.float()


@hybridep_dispatch_backward.register_fake
def _(grad_rows, grad_probs, handle_id, num_tokens, num_experts):
    return (
        grad_rows.new_empty(num_tokens, grad_rows.shape[1]),
        grad_probs.new_empty(num_tokens, num_experts, dtype=torch.float32),
    )


@torch.library.custom_op("moevlm_hybridep::combine_backward", mutates_args=())
def hybridep_combine_backward(grad_y: Tensor, handle_id: Tensor, num_rows: int) -> Tensor:
    """combine's backward: a cached dispatch_with_permute of the gradient (the saved layout, no probs)."""
    buffer, handle, pad = lookup(handle_id)
    return buffer.dispatch_with_permute(
        hidden=grad_y.contiguous(), handle=handle, num_permuted_tokens=num_rows, pad_multiple=pad
    )[0]


@hybridep_combine_backward.register_fake
def _(grad_y, handle_id, num_rows):
    return grad_y.new_empty(num_rows, grad_y.shape[1])


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.num_tokens, ctx.num_experts = inputs[0].shape[0], inputs[2].shape[1]
    ctx.rows_shape, ctx.dtype, ctx.device = output[0].shape, output[0].dtype, output[0].device


def _dispatch_grad(ctx, grad_rows, grad_probs, grad_counts, grad_flag, grad_id):
    """A gradient autograd leaves out (an output nothing used) is zeros on the rows' device: HybridEP's
    combine takes device tensors."""
    (handle_id,) = ctx.saved_tensors
    if grad_rows is None:
        grad_rows = torch.zeros(ctx.rows_shape, dtype=ctx.dtype, device=ctx.device)
    if grad_probs is None:
        grad_probs = torch.zeros(ctx.rows_shape[0], dtype=torch.float32, device=ctx.device)
    gx, gprobs = hybridep_dispatch_backward(
        grad_rows, grad_probs, handle_id, ctx.num_tokens, ctx.num_experts
    )
    return gx, None, gprobs, None, None, None, None


hybridep_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)
register_combine_autograd(hybridep_combine, hybridep_combine_backward)


# ----------------------------------------------------------------- index logic (pure, no host reads)
def permuted_budget(
    capacity_factor: float,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    num_local_experts: int,
    pad_multiple: int = 1,
) -> int:
    """`num_permuted_tokens` of the capacity mode: E*C rows (C as the capacity all-to-all's), room for each
    local expert's padding, rounded up to the pad."""
    rows = num_experts * expert_capacity(capacity_factor, num_tokens, top_k, num_experts)
    rows += num_local_experts * (pad_multiple - 1)
    return -(-rows // pad_multiple) * pad_multiple


def fit_counts(counts_L: Tensor, budget: int) -> Tensor:
    """Rows per local expert as the grouped GEMM must see them: clipped to the first `budget` rows, the unused
    tail given to the last expert, so they sum to `budget`."""
    ends = torch.cumsum(counts_L, 0).clamp(max=budget)
    ends = torch.cat([ends[:-1], ends.new_full((1,), budget)])
    return torch.diff(ends, prepend=ends.new_zeros(1))


def dropped_rows(routed_L: Tensor, budget: int, pad_multiple: int = 1) -> Tensor:
    """Routed rows (not padding) past `budget` in HybridEP's permuted order, from the true rows per local
    expert: expert e's rows sit at [s_e, s_e + routed_e), s_e the padded blocks before it."""
    padded = -(-routed_L // pad_multiple) * pad_multiple
    start = torch.cumsum(padded, 0) - padded
    return (start + routed_L - budget).clamp(min=0).minimum(routed_L).sum()


def used_rows(counts_L: Tensor, budget: int) -> Tensor:
    """(M,) bool on the counts' device: the permuted rows HybridEP wrote under a `budget` of M rows (its
    rows per local expert, padding included, clipped to the budget); the rest it never writes."""
    return torch.arange(budget, device=counts_L.device) < counts_L.sum().clamp(max=budget)


@dataclass
class HybridEPHandle:
    handle_id: Tensor  # HybridEP's handle, in moevlm.dispatch.handles
    row_weight_M: Tensor  # the router weight of every permuted row (0 on padding and empty rows)
    num_tokens: int  # T on this rank
    padded_tokens: int  # T' handed to HybridEP
    # capacity mode: the rows HybridEP wrote (the rest it never writes)
    used_M: Tensor | None = None


@register_dispatcher
class HybridEPDispatcher(TokenDispatcher):
    name = "hybridep"
    pads_experts = True  # HybridEP pads each expert's rows itself (`pad_multiple`, set for FP8 by moevlm.model.fp8)

    @property
    def exchanges(self) -> bool:
        return self.ep_size > 1

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group=None,
        etp_group=None,
        permute: str = "torch",
        capacity_factor: float | None = None,
        capacity_overflow: str = "drop",
        max_tokens_per_rank: int | None = None,
        num_sms: int = 0,
    ):
        """`capacity_factor` (None = dropless) selects the no-sync mode (docs/dispatchers.md);
        `max_tokens_per_rank`: a static T' (no all-reduce of token counts); `num_sms`: SMs of HybridEP's
        dispatch and combine kernels (0: its defaults)."""
        super().__init__(num_experts, top_k)
        reason = self.unavailable_reason(
            num_experts=num_experts, ep_group=ep_group, etp_group=etp_group, check_package=False
        )
        if reason is not None:
            raise ValueError(reason)
        self.group, self.ep_size, self.ep_rank = _resolve_group(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor, self.capacity_overflow = capacity_factor, capacity_overflow
        if capacity_factor is not None:
            _check_capacity(capacity_factor, capacity_overflow, 1)
        self.max_tokens_per_rank, self.num_sms = max_tokens_per_rank, num_sms
        # capacity mode, read by moevlm.dispatch.capacity.OverflowCounter: dropped rows and flagged
        # dispatches (device tensors), routed rows (host int)
        self.dropped, self.flagged, self.routed = None, None, 0

    @classmethod
    def unavailable_reason(
        cls, num_experts: int, ep_group=None, etp_group=None, check_package: bool = True, **kwargs
    ) -> str | None:
        from moevlm.dispatch.availability import (
            hybridep_domain_size,
            hybridep_env_problem,
            hybridep_layout_problem,
            unavailable_reason,
        )

        reason = unavailable_reason("hybridep") if check_package else None
        if reason is not None:
            return reason
        if hybridep_env_problem() is not None:
            return hybridep_env_problem()
        if etp_group is not None and dist.get_world_size(etp_group) > 1:
            return (
                f"moevlm's hybridep adapter has no expert tensor parallel (parallel.etp="
                f"{dist.get_world_size(etp_group)}); use parallel.etp=1, or model.dispatcher=alltoall"
            )
        return hybridep_layout_problem(
            _resolve_group(ep_group)[1], num_experts, hybridep_domain_size()
        )

    def padded_tokens(self, num_tokens: int, device) -> int:
        """T' (see the module docstring)."""
        if self.max_tokens_per_rank is None and self.capacity_factor is not None:
            bound = num_tokens
        else:
            # without a static bound, the dropless mode's one extra host read
            bound = token_bound(
                self.group, num_tokens, device, self.max_tokens_per_rank, "hybridep"
            )
        return -(-bound // TOKEN_ALIGN) * TOKEN_ALIGN

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        (T, K), D, E, L = topk_idx_TK.shape, x_TD.shape[1], self.num_experts, self.num_local_experts
        T_pad = self.padded_tokens(T, x_TD.device)
        _buffer(self.group, D, T_pad, L, self.num_sms)
        routing_map_TE, probs_TE = dense_routing(topk_idx_TK, topk_w_TK, E)
        # HybridEP moves bf16 rows; autograd casts the gradient back to x's dtype
        wire_TD = x_TD.to(WIRE_DTYPE)
        if T_pad > T:
            routing_map_TE = torch.cat([routing_map_TE, routing_map_TE.new_zeros(T_pad - T, E)])
            probs_TE = torch.cat([probs_TE, probs_TE.new_zeros(T_pad - T, E)])
            wire_TD = torch.cat([wire_TD, wire_TD.new_zeros(T_pad - T, D)])
        budget = None
        if self.capacity_factor is not None:
            # C from the real tokens: the padding routes nowhere
            budget = permuted_budget(self.capacity_factor, T, K, E, L, self.pad_multiple)
        rows_MD, weight_M, counts_L, flag, handle_id = hybridep_dispatch(
            wire_TD,
            routing_map_TE,
            probs_TE,
            self.group.group_name,
            L,
            -1 if budget is None else budget,
            self.pad_multiple,
        )
        used_M = None
        if budget is not None:
            self._count(routing_map_TE, flag, budget, T * K)
            used_M = used_rows(counts_L, budget)
            rows_MD = torch.where(used_M[:, None], rows_MD, 0.0)
            weight_M = torch.where(used_M, weight_M, 0.0)
            counts_L = fit_counts(counts_L, budget)
        handle = HybridEPHandle(handle_id, weight_M, T, T_pad, used_M)
        return rows_MD.to(x_TD.dtype), counts_L, handle

    def _count(self, routing_map_TE: Tensor, flag: Tensor, budget: int, routed: int) -> None:
        """Capacity mode: this rank's dropped rows (exact, from the group's routing counts: one functional
        all-reduce of E ints, no host read) and the overflow flag, added on the device; a recompute in
        backward is not counted."""
        if in_backward():
            return
        per_expert_E = funcol.all_reduce(routing_map_TE.sum(0), "sum", self.group)
        L, r = self.num_local_experts, self.ep_rank
        dropped = dropped_rows(per_expert_E[r * L : (r + 1) * L], budget, self.pad_multiple)
        add_overflow(self, dropped, (flag != 0).sum(), routed)

    def combine(self, expert_y_MD, handle: HybridEPHandle):
        # router weights: here, once
        weighted_MD = expert_y_MD * handle.row_weight_M.to(expert_y_MD.dtype)[:, None]
        if handle.used_M is not None:
            # in backward: the cached re-dispatch leaves the unused rows' gradient unwritten
            weighted_MD = torch.where(handle.used_M[:, None], weighted_MD, 0.0)
        y_TD = hybridep_combine(weighted_MD.to(WIRE_DTYPE), handle.handle_id, handle.padded_tokens)
        return y_TD[: handle.num_tokens].to(expert_y_MD.dtype)
