"""The `deepep` dispatcher: DeepEP behind our interface, through its V2 `deep_ep.ElasticBuffer` or
its V1 `deep_ep.Buffer` in normal mode (`api="auto"` takes V2 where installed; docs/dispatchers.md).

Legend as in `base.py`, plus P ranks in the EP group, L = E / P experts per rank, R rows DeepEP
delivers here (one per (source token, this rank)), M expert rows after the local permute, C the
token bound of every rank (V2's `num_max_tokens_per_rank`).

    dispatch: V1: preprocess = buffer.get_dispatch_layout -> moevlm_deepep::dispatch
              V2: C = the group's largest T (an all-reduce) -> moevlm_deepep::dispatch_v2
              -> R rows, their top-k as local expert ids; local permute: one row per local choice
    combine:  local un-permute, scaled by the received router weights, summed per row
              -> moevlm_deepep::combine (DeepEP's sum is unweighted)
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moevlm.dispatch.alltoall import _resolve_group
from moevlm.dispatch.availability import DEEPEP_API_CLASS
from moevlm.dispatch.base import TokenDispatcher, register_dispatcher, token_bound
from moevlm.dispatch.handles import HANDLES, lookup, register_combine_autograd, store
from moevlm.model.rows import RowsState, from_expert_rows, rows_plan

log = logging.getLogger(__name__)
APIS = ("auto", *DEEPEP_API_CLASS)  # auto, v2, v1
WIRE_DTYPE = torch.bfloat16  # the only row dtype DeepEP's normal-mode kernels take
FALLBACK_NUM_SMS = 24  # V2's SMs when its own estimate fails (no RDMA bandwidth detected)
# (API, EP group name) -> deep_ep.Buffer / deep_ep.ElasticBuffer
_BUFFERS: dict[tuple[str, str], object] = {}
_RETIRED: list = []  # outgrown V2 buffers, destroyed once no handle refers to them
_sms_fallback_logged: set[str] = set()


@contextlib.contextmanager
def deepep_call():
    """Around every DeepEP call: `fill_uninitialized_memory` off while deterministic algorithms are on
    (DeepEP asserts otherwise), restored after."""
    from torch.utils import deterministic

    fill = deterministic.fill_uninitialized_memory
    if fill and torch.are_deterministic_algorithms_enabled():
        deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = fill


# ----------------------------------------------------------------- API, buffers and handles
def resolve_api(api: str) -> str:
    """The DeepEP API to drive for `api`: "v2" (`ElasticBuffer`) or "v1" (`Buffer`); "auto" takes V2
    where the installed deep_ep offers it.  Imports deep_ep."""
    from moevlm.dispatch.availability import unavailable_reason

    if api not in APIS:
        raise ValueError(f"deepep dispatcher api={api!r}; choose one of {list(APIS)}")
    import deep_ep

    if api == "auto":
        return "v2" if hasattr(deep_ep, DEEPEP_API_CLASS["v2"]) else "v1"
    if not hasattr(deep_ep, DEEPEP_API_CLASS[api]):
        raise RuntimeError(
            f"deepep dispatcher api={api!r} cannot run: {unavailable_reason('deepep', api=api)}"
        )
    return api


def _buffer(group, hidden_bytes: int, num_sms: int = 0):
    """The group's deep_ep.Buffer, with room for rows of `hidden_bytes` (built or grown here); `num_sms` > 0
    sets DeepEP's SM count (process-wide in V1) first, since its configs size the buffer by it."""
    from deep_ep import Buffer

    if num_sms:
        Buffer.set_num_sms(num_sms)
    P = dist.get_world_size(group)
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(P), Buffer.get_combine_config(P)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, P))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, P))
    have = _BUFFERS.get(("v1", group.group_name))
    if have is None or have.num_nvl_bytes < nvl or have.num_rdma_bytes < rdma:
        _BUFFERS["v1", group.group_name] = have = Buffer(group, nvl, rdma)
    return have


def _elastic_buffer(group, num_tokens: int, hidden: int, num_topk: int):
    """The group's deep_ep.ElasticBuffer, with room for `num_tokens` tokens per rank of `hidden` (built or
    grown here, on every rank of the group at once: `num_tokens` is the group's largest)."""
    from deep_ep import ElasticBuffer

    have = _BUFFERS.get(("v2", group.group_name))
    if (
        have is not None
        and have.num_max_tokens_per_rank >= num_tokens
        and have.num_bytes
        >= (
            ElasticBuffer.get_buffer_size_hint(
                group, have.num_max_tokens_per_rank, hidden, num_topk
            )
        )
    ):
        return have
    bound = max(num_tokens, 1 if have is None else have.num_max_tokens_per_rank)
    bound = 1 << (bound - 1).bit_length()  # a power of two: few rebuilds, few kernel variants
    if have is not None:
        _RETIRED.append(have)
    _destroy_retired()
    _BUFFERS["v2", group.group_name] = have = ElasticBuffer(
        group,
        num_bytes=ElasticBuffer.get_buffer_size_hint(group, bound, hidden, num_topk),
        num_max_tokens_per_rank=bound,
        hidden=hidden,
        num_topk=num_topk,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        explicitly_destroy=True,
    )
    return have


def _destroy_retired() -> None:
    """`destroy()` the outgrown V2 buffers no live handle refers to (their registered memory leaks otherwise)."""
    in_use = {id(entry[0]) for entry in HANDLES.values()}
    for buffer in [b for b in _RETIRED if id(b) not in in_use]:
        _RETIRED.remove(buffer)
        with deepep_call():
            buffer.destroy()


def v2_num_sms(buffer, num_experts: int, num_topk: int, group_name: str) -> int:
    """V2's SM count: its own estimate, or FALLBACK_NUM_SMS where that fails (it divides by the RDMA
    bandwidth it detects, zero across nodes without `ibstat` / `mlx5_0`)."""
    try:
        return buffer.get_theoretical_num_sms(num_experts, num_topk)
    except ZeroDivisionError:
        if group_name not in _sms_fallback_logged:
            _sms_fallback_logged.add(group_name)
            log.warning(
                "DeepEP V2 could not estimate its SM count (no RDMA bandwidth detected); using %d "
                "(set model.dispatcher_num_sms to choose)",
                FALLBACK_NUM_SMS,
            )
        return FALLBACK_NUM_SMS


# ----------------------------------------------------------------- the exchanges as custom ops
@torch.library.custom_op("moevlm_deepep::dispatch", mutates_args=())
def deepep_dispatch(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    num_tokens_per_rank: Tensor,
    num_tokens_per_rdma_rank: Optional[Tensor],
    is_token_in_rank: Tensor,
    num_tokens_per_expert: Tensor,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """V1 buffer.dispatch -> (recv_x_RD, recv_topk_idx_RK (local ids, -1), recv_topk_weights_RK, tokens per
    local expert (CPU int64), handle id)."""
    buffer = _BUFFERS["v1", group_name]
    with deepep_call():
        recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
    return (
        recv_x,
        recv_idx,
        recv_w,
        torch.tensor(per_expert, dtype=torch.int64),
        store(buffer, handle, {}),
    )


@deepep_dispatch.register_fake
def _(
    x,
    topk_idx,
    topk_weights,
    num_tokens_per_rank,
    num_tokens_per_rdma_rank,
    is_token_in_rank,
    num_tokens_per_expert,
    group_name,
):
    R, K = torch.library.get_ctx().new_dynamic_size(), topk_idx.shape[1]
    L = num_tokens_per_expert.shape[0] // num_tokens_per_rank.shape[0]
    return (
        x.new_empty(R, x.shape[1]),
        topk_idx.new_empty(R, K),
        topk_weights.new_empty(R, K),
        torch.empty(L, dtype=torch.int64),
        torch.empty(1, dtype=torch.int64),
    )


@torch.library.custom_op("moevlm_deepep::dispatch_v2", mutates_args=())
def deepep_dispatch_v2(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    num_local_experts: int,
    group_name: str,
    num_sms: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """V2 buffer.dispatch (compact, with the CPU sync) under the buffer's C, on `num_sms` SMs, as
    `deepep_dispatch`."""
    buffer = _BUFFERS["v2", group_name]
    with deepep_call():
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=num_experts,
            num_max_tokens_per_rank=buffer.num_max_tokens_per_rank,
            num_sms=num_sms,
            do_cpu_sync=True,
        )
    per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
    return recv_x, recv_idx, recv_w, per_expert, store(buffer, handle, {"num_sms": handle.num_sms})


@deepep_dispatch_v2.register_fake
def _(x, topk_idx, topk_weights, num_experts, num_local_experts, group_name, num_sms):
    R, K = torch.library.get_ctx().new_dynamic_size(), topk_idx.shape[1]
    return (
        x.new_empty(R, x.shape[1]),
        topk_idx.new_empty(R, K),
        topk_weights.new_empty(R, K),
        torch.empty(num_local_experts, dtype=torch.int64),
        torch.empty(1, dtype=torch.int64),
    )


@torch.library.custom_op("moevlm_deepep::combine", mutates_args=())
def deepep_combine(y: Tensor, handle_id: Tensor, num_tokens: int) -> Tensor:
    """buffer.combine: the unweighted sum, per source token, of the rows sent back."""
    buffer, handle, _ = lookup(handle_id)
    with deepep_call():
        return buffer.combine(y, handle)[0]


@deepep_combine.register_fake
def _(y, handle_id, num_tokens):
    return y.new_empty(num_tokens, y.shape[1])


@torch.library.custom_op("moevlm_deepep::dispatch_backward", mutates_args=())
def deepep_dispatch_backward(
    grad_x: Tensor, grad_weights: Tensor, handle_id: Tensor, num_tokens: int
) -> tuple[Tensor, Tensor]:
    """dispatch's backward: a combine of the row and the top-k weight gradients on the saved handle."""
    buffer, handle, _ = lookup(handle_id)
    with deepep_call():
        gx, gw, _ = buffer.combine(
            grad_x.contiguous(), handle, topk_weights=grad_weights.contiguous()
        )
    return gx, gw


@deepep_dispatch_backward.register_fake
def _(grad_x, grad_weights, handle_id, num_tokens):
    return grad_x.new_empty(num_tokens, grad_x.shape[1]), grad_weights.new_empty(
        num_tokens, grad_weights.shape[1]
    )


@torch.library.custom_op("moevlm_deepep::combine_backward", mutates_args=())
def deepep_combine_backward(grad_y: Tensor, handle_id: Tensor, num_rows: int) -> Tensor:
    """combine's backward: a cached dispatch (the saved handle's layout, no top-k)."""
    buffer, handle, redispatch = lookup(handle_id)
    with deepep_call():
        return buffer.dispatch(grad_y.contiguous(), handle=handle, **redispatch)[0]


@deepep_combine_backward.register_fake
def _(grad_y, handle_id, num_rows):
    return grad_y.new_empty(num_rows, grad_y.shape[1])


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.num_tokens, ctx.num_inputs = inputs[0].shape[0], len(inputs)
    ctx.shapes, ctx.dtypes = (output[0].shape, output[2].shape), (output[0].dtype,)
    ctx.device = output[0].device


def _dispatch_grad(ctx, grad_x, grad_idx, grad_w, grad_counts, grad_id):
    """A gradient autograd leaves out (an output nothing used) is zeros on the rows' device: DeepEP's
    combine takes device tensors."""
    (handle_id,) = ctx.saved_tensors
    if grad_x is None:
        grad_x = torch.zeros(ctx.shapes[0], dtype=ctx.dtypes[0], device=ctx.device)
    if grad_w is None:
        grad_w = torch.zeros(ctx.shapes[1], dtype=torch.float32, device=ctx.device)
    gx, gw = deepep_dispatch_backward(grad_x, grad_w, handle_id, ctx.num_tokens)
    return (
        gx,
        None,
        gw,
        *[None] * (ctx.num_inputs - 3),
    )  # x, topk_idx, topk_weights, then the layout / ints


deepep_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)
deepep_dispatch_v2.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)
register_combine_autograd(deepep_combine, deepep_combine_backward)


# ----------------------------------------------------------------- local permute (pure index logic)
def local_rows_plan(
    recv_topk_idx_RK: Tensor, recv_topk_w_RK: Tensor, num_local_experts: int, num_rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(received row of every expert row, its router weight, rows per local expert) for the `num_rows`
    local choices of the received rows, stable-sorted by local expert; -1 (not here) sorts last, dropped."""
    L = num_local_experts
    idx_RK = torch.where(recv_topk_idx_RK >= 0, recv_topk_idx_RK, L)
    row_N, weight_N, counts = rows_plan(idx_RK, recv_topk_w_RK, L + 1)
    return row_N[:num_rows], weight_N[:num_rows], counts[:L]


@dataclass
class DeepEPHandle:
    rows: RowsState  # the local permute: received row and router weight of every expert row
    handle_id: Tensor  # DeepEP's handle, in moevlm.dispatch.handles
    num_tokens: int  # T on this rank


@register_dispatcher
class DeepEPDispatcher(TokenDispatcher):
    name = "deepep"

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
        api: str = "auto",
        num_sms: int = 0,
        max_tokens_per_rank: int | None = None,
    ):
        """`api`: "auto", "v2" or "v1" (see the module docstring); `num_sms`: SMs for DeepEP's kernels (0:
        DeepEP's choice; even for V1); `max_tokens_per_rank`: V2's static C (no all-reduce of token counts)."""
        super().__init__(num_experts, top_k)
        reason = self.unavailable_reason(
            num_experts=num_experts,
            ep_group=ep_group,
            etp_group=etp_group,
            permute=permute,
            api=api,
            num_sms=num_sms,
            check_package=False,
        )
        if reason is not None:
            raise ValueError(reason)
        self.group, self.ep_size, self.ep_rank = _resolve_group(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.api, self._api = api, None  # as asked; as resolved at the first use ("v1" / "v2")
        self.num_sms, self.max_tokens_per_rank = num_sms, max_tokens_per_rank
        self.buffer = None

    @classmethod
    def unavailable_reason(
        cls,
        num_experts: int,
        ep_group=None,
        etp_group=None,
        permute: str = "torch",
        api: str = "auto",
        num_sms: int = 0,
        check_package: bool = True,
        **kwargs,
    ) -> str | None:
        from moevlm.dispatch.availability import (
            deepep_layout_problem,
            deepep_rules_api,
            launch_ranks_per_node,
            unavailable_reason,
        )

        if api not in APIS:
            return f"moevlm's deepep adapter takes api='auto', 'v2' or 'v1' (api={api!r})"
        if num_sms < 0 or num_sms % 2:
            return f"DeepEP takes an even SM count, 0 for its own choice (num_sms={num_sms})"
        reason = unavailable_reason("deepep", api=api) if check_package else None
        if reason is not None:
            return reason
        if etp_group is not None and dist.get_world_size(etp_group) > 1:
            return (
                f"moevlm's deepep adapter has no expert tensor parallel (parallel.etp="
                f"{dist.get_world_size(etp_group)}); use parallel.etp=1, or model.dispatcher=alltoall"
            )
        if permute != "torch":
            return f"moevlm's deepep adapter permutes with torch only (model.permute={permute!r})"
        return deepep_layout_problem(
            _resolve_group(ep_group)[1],
            num_experts,
            launch_ranks_per_node(),
            deepep_rules_api(api, check_package),
        )

    @property
    def resolved_api(self) -> str:
        """ "v1" or "v2": the API this dispatcher drives (`resolve_api`, once; imports deep_ep)."""
        if self._api is None:
            self._api = resolve_api(self.api)
            self._check_v1_layout()
        return self._api

    def _check_v1_layout(self) -> None:
        """ "auto" resolved to V1: its layout rules, stricter than V2's the constructor checked."""
        from moevlm.dispatch.availability import deepep_layout_problem, launch_ranks_per_node

        if self._api != "v1":
            return
        problem = deepep_layout_problem(
            self.ep_size, self.num_experts, launch_ranks_per_node(), "v1"
        )
        if problem is not None:
            raise ValueError(problem)

    def preprocess(self, topk_idx_TK, topk_w_TK):
        """V1: DeepEP's layout of this routing (tokens per rank, per RDMA rank, per expert, token x rank map);
        needs the group's buffer (built by the first `dispatch`).  V2 has no such step: None."""
        if self.resolved_api == "v2":
            return None
        if self.buffer is None:
            raise RuntimeError(
                "DeepEPDispatcher.preprocess runs inside dispatch (the buffer is built there)"
            )
        with deepep_call():
            per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
                topk_idx_TK, self.num_experts
            )
        return per_rank, per_rdma_rank, per_expert, in_rank

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        topk_idx_TK, topk_w_TK = topk_idx_TK.contiguous(), topk_w_TK.float().contiguous()
        # DeepEP moves bf16 rows; autograd casts the gradient back to x's dtype
        wire_TD = x_TD.to(WIRE_DTYPE)
        if self.resolved_api == "v2":
            received = self._dispatch_v2(wire_TD, topk_idx_TK, topk_w_TK)
        else:
            self.buffer = _buffer(self.group, x_TD.shape[1] * WIRE_DTYPE.itemsize, self.num_sms)
            per_rank, per_rdma_rank, per_expert, in_rank = self.preprocess(topk_idx_TK, topk_w_TK)
            received = deepep_dispatch(
                wire_TD,
                topk_idx_TK,
                topk_w_TK,
                per_rank,
                per_rdma_rank,
                in_rank,
                per_expert,
                self.group.group_name,
            )
        recv_x_RD, recv_idx_RK, recv_w_RK, per_local_expert, handle_id = received
        M = int(per_local_expert.sum())  # a CPU tensor: DeepEP's host list, no further sync
        row_M, weight_M, counts_L = local_rows_plan(
            recv_idx_RK, recv_w_RK, self.num_local_experts, M
        )
        rows = RowsState(recv_x_RD.shape[0], token_idx_N=row_M, weight_N=weight_M)
        expert_x_MD = recv_x_RD[row_M].to(x_TD.dtype)
        return expert_x_MD, counts_L, DeepEPHandle(rows, handle_id, x_TD.shape[0])

    def _dispatch_v2(self, wire_TD, topk_idx_TK, topk_w_TK):
        """V2: the buffer for the group's bound C (built or grown), then the dispatch on the SMs resolved."""
        T, name = wire_TD.shape[0], self.group.group_name
        C = token_bound(self.group, T, wire_TD.device, self.max_tokens_per_rank, "deepep")
        self.buffer = _elastic_buffer(self.group, C, wire_TD.shape[1], self.top_k)
        num_sms = self.num_sms or v2_num_sms(self.buffer, self.num_experts, self.top_k, name)
        return deepep_dispatch_v2(
            wire_TD,
            topk_idx_TK,
            topk_w_TK,
            self.num_experts,
            self.num_local_experts,
            name,
            num_sms,
        )

    def combine(self, expert_y_MD, handle: DeepEPHandle):
        y_RD = from_expert_rows(expert_y_MD, handle.rows)  # router weights applied here, once
        y_TD = deepep_combine(y_RD.to(WIRE_DTYPE), handle.handle_id, handle.num_tokens)
        return y_TD.to(expert_y_MD.dtype)
