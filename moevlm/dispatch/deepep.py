"""The `deepep` dispatcher: DeepEP's V1 `deep_ep.Buffer` (normal mode) behind our interface.

Legend as in `base.py`, plus P ranks in the EP group, L = E / P experts per rank, R rows DeepEP delivers
to this rank (one per (source token, this rank) pair, whatever the number of its local choices), M
expert rows after the local permute (one per (received token, local choice)).

    dispatch: preprocess = buffer.get_dispatch_layout(topk_idx, E)         (tokens per rank / expert, map)
              -> moevlm_deepep::dispatch: buffer.dispatch(x, topk_idx, topk_w, layout) -> R rows,
                 their top-k as local expert ids (-1: not here, weight 0), tokens per local expert
              -> local permute: each received row once per local choice, stable-sorted by local expert
    combine:  local un-permute, scaled by the received router weights (here, once), summed per row
              -> moevlm_deepep::combine: buffer.combine(y_RD, handle) (DeepEP's sum is unweighted)

Design choices:
- `deep_ep` is imported only when a buffer is built (`_buffer`), so moevlm imports without it; the
  availability gate (`availability.py`) refuses a missing package first, naming it.
- One `deep_ep.Buffer` per EP group (module level, keyed by the group's name), built lazily on the first
  dispatch with NVLink / RDMA sizes the package's own hints give (`get_dispatch_config(P)` and
  `get_combine_config(P)`, each `get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` for the row
  width, bf16 at least: the larger of the two); rebuilt only if a wider row needs more.
- Router weights are applied on the expert's rank (the only place a token's per-expert outputs are
  apart: DeepEP's combine sums them), from `recv_topk_weights`; their gradient goes back to the source
  through the combine of `topk_weights` in dispatch's backward (each choice is local on one rank only,
  the others carry 0).
- The exchanges are `torch.library.custom_op`s with fakes (`moevlm_deepep::dispatch`, `combine` and
  their backward ops) so selective recompute can save their outputs (`recompute.COMM_NAMESPACES`) and
  torch.compile can trace around them.  An op cannot take DeepEP's opaque handle, so it lives in
  `_HANDLES` under an int id carried by a one-element int64 CPU tensor; the entry goes when that tensor's
  storage does (`weakref.finalize`; a detached alias, as selective recompute saves, keeps it): after
  backward, or at once when nothing needs grad.  Backward is the
  opposite collective on the saved handle, as DeepEP's V1 tests do: dispatch's a combine (of the row
  and the weight gradients), combine's a cached dispatch.
- The one host sync is DeepEP's own (its per-expert list, here a CPU tensor): it sizes the local rows.
  Received rows are in source-rank, then source-token order, so every expert's rows come out in the
  order the `alltoall` dispatcher gives them.
- Not built: V2 `ElasticBuffer`, low-latency mode, fp8 dispatch, `num_worst_tokens` (no-sync) mode,
  async events / comm-stream overlap, expert tensor parallel.  Never run here against the real package:
  the tests use an emulator of its documented API (tests/dispatch/deep_ep_emulator).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moevlm.dispatch.alltoall import _resolve_group
from moevlm.dispatch.base import TokenDispatcher, register_dispatcher
from moevlm.dispatch.rows import RowsState, from_expert_rows, rows_plan

_BUFFERS: dict[str, object] = {}  # EP group name -> deep_ep.Buffer
_HANDLES: dict[int, tuple[object, object]] = {}  # handle id -> (buffer, DeepEP handle)
_ids = itertools.count()


# ----------------------------------------------------------------- buffers and handles
def _buffer(group, hidden_bytes: int):
    """The group's deep_ep.Buffer, with room for rows of `hidden_bytes` (built or grown here)."""
    from deep_ep import Buffer

    P = dist.get_world_size(group)
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(P), Buffer.get_combine_config(P)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, P))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, P))
    have = _BUFFERS.get(group.group_name)
    if have is None or have.num_nvl_bytes < nvl or have.num_rdma_bytes < rdma:
        _BUFFERS[group.group_name] = have = Buffer(group, nvl, rdma)
    return have


def _store(buffer, handle) -> Tensor:
    """Keep (buffer, handle) under a fresh id, for as long as the returned id tensor lives."""
    hid = next(_ids)
    _HANDLES[hid] = (buffer, handle)
    id_tensor = torch.tensor([hid], dtype=torch.int64)
    weakref.finalize(id_tensor.untyped_storage(), _HANDLES.pop, hid, None)  # shared by its aliases (detach)
    return id_tensor


def _lookup(handle_id: Tensor):
    return _HANDLES[int(handle_id[0])]


# ----------------------------------------------------------------- the exchanges as custom ops
@torch.library.custom_op("moevlm_deepep::dispatch", mutates_args=())
def deepep_dispatch(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_tokens_per_rank: Tensor,
                    num_tokens_per_rdma_rank: Optional[Tensor], is_token_in_rank: Tensor,
                    num_tokens_per_expert: Tensor, group_name: str
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """buffer.dispatch -> (recv_x_RD, recv_topk_idx_RK (local ids, -1), recv_topk_weights_RK, tokens per
    local expert (CPU int64), handle id)."""
    buffer = _BUFFERS[group_name]
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
        topk_weights=topk_weights)
    return recv_x, recv_idx, recv_w, torch.tensor(per_expert, dtype=torch.int64), _store(buffer, handle)


@deepep_dispatch.register_fake
def _(x, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
      num_tokens_per_expert, group_name):
    R, K = torch.library.get_ctx().new_dynamic_size(), topk_idx.shape[1]
    L = num_tokens_per_expert.shape[0] // num_tokens_per_rank.shape[0]
    return (x.new_empty(R, x.shape[1]), topk_idx.new_empty(R, K), topk_weights.new_empty(R, K),
            torch.empty(L, dtype=torch.int64), torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("moevlm_deepep::combine", mutates_args=())
def deepep_combine(y: Tensor, handle_id: Tensor, num_tokens: int) -> Tensor:
    """buffer.combine: the unweighted sum, per source token, of the rows sent back."""
    buffer, handle = _lookup(handle_id)
    return buffer.combine(y, handle)[0]


@deepep_combine.register_fake
def _(y, handle_id, num_tokens):
    return y.new_empty(num_tokens, y.shape[1])


@torch.library.custom_op("moevlm_deepep::dispatch_backward", mutates_args=())
def deepep_dispatch_backward(grad_x: Tensor, grad_weights: Tensor, handle_id: Tensor,
                             num_tokens: int) -> tuple[Tensor, Tensor]:
    """dispatch's backward: a combine of the row and the top-k weight gradients on the saved handle."""
    buffer, handle = _lookup(handle_id)
    gx, gw, _ = buffer.combine(grad_x.contiguous(), handle, topk_weights=grad_weights.contiguous())
    return gx, gw


@deepep_dispatch_backward.register_fake
def _(grad_x, grad_weights, handle_id, num_tokens):
    return grad_x.new_empty(num_tokens, grad_x.shape[1]), grad_weights.new_empty(num_tokens, grad_weights.shape[1])


@torch.library.custom_op("moevlm_deepep::combine_backward", mutates_args=())
def deepep_combine_backward(grad_y: Tensor, handle_id: Tensor, num_rows: int) -> Tensor:
    """combine's backward: a cached dispatch (the saved handle's layout, no top-k)."""
    buffer, handle = _lookup(handle_id)
    return buffer.dispatch(grad_y.contiguous(), handle=handle)[0]


@deepep_combine_backward.register_fake
def _(grad_y, handle_id, num_rows):
    return grad_y.new_empty(num_rows, grad_y.shape[1])


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.num_tokens = inputs[0].shape[0]
    ctx.shapes, ctx.dtypes = (output[0].shape, output[2].shape), (output[0].dtype,)


def _dispatch_grad(ctx, grad_x, grad_idx, grad_w, grad_counts, grad_id):
    (handle_id,) = ctx.saved_tensors
    grad_x = torch.zeros(ctx.shapes[0], dtype=ctx.dtypes[0]) if grad_x is None else grad_x
    grad_w = torch.zeros(ctx.shapes[1], dtype=torch.float32) if grad_w is None else grad_w
    gx, gw = deepep_dispatch_backward(grad_x, grad_w, handle_id, ctx.num_tokens)
    return gx, None, gw, None, None, None, None, None


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.num_rows = inputs[0].shape[0]


def _combine_grad(ctx, grad):
    (handle_id,) = ctx.saved_tensors
    return deepep_combine_backward(grad, handle_id, ctx.num_rows), None, None


deepep_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)
deepep_combine.register_autograd(_combine_grad, setup_context=_combine_setup)


# ----------------------------------------------------------------- local permute (pure index logic)
def local_rows_plan(recv_topk_idx_RK: Tensor, recv_topk_w_RK: Tensor, num_local_experts: int,
                    num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(received row of every expert row, its router weight, rows per local expert) for the `num_rows`
    local choices of the received rows, stable-sorted by local expert; -1 (not here) sorts last, dropped."""
    L = num_local_experts
    idx_RK = torch.where(recv_topk_idx_RK >= 0, recv_topk_idx_RK, L)
    row_N, weight_N, counts = rows_plan(idx_RK, recv_topk_w_RK, L + 1)
    return row_N[:num_rows], weight_N[:num_rows], counts[:L]


@dataclass
class DeepEPHandle:
    rows: RowsState  # the local permute: received row and router weight of every expert row
    handle_id: Tensor  # DeepEP's handle, in _HANDLES
    num_tokens: int  # T on this rank


@register_dispatcher
class DeepEPDispatcher(TokenDispatcher):
    name = "deepep"

    def __init__(self, num_experts: int, top_k: int, ep_group=None, etp_group=None, permute: str = "torch"):
        super().__init__(num_experts, top_k)
        reason = self.unavailable_reason(num_experts=num_experts, ep_group=ep_group, etp_group=etp_group,
                                         permute=permute, check_package=False)
        if reason is not None:
            raise ValueError(reason)
        self.group, self.ep_size, self.ep_rank = _resolve_group(ep_group)
        self.num_local_experts = num_experts // self.ep_size
        self.buffer = None

    @classmethod
    def unavailable_reason(cls, num_experts: int, ep_group=None, etp_group=None, permute: str = "torch",
                           check_package: bool = True, **kwargs) -> str | None:
        from moevlm.dispatch.availability import deepep_layout_problem, launch_ranks_per_node, unavailable_reason

        reason = unavailable_reason("deepep") if check_package else None
        if reason is not None:
            return reason
        if etp_group is not None and dist.get_world_size(etp_group) > 1:
            return (f"moevlm's deepep adapter has no expert tensor parallel (parallel.etp="
                    f"{dist.get_world_size(etp_group)}); use parallel.etp=1, or model.dispatcher=alltoall")
        if permute != "torch":
            return f"moevlm's deepep adapter permutes with torch only (model.permute={permute!r})"
        return deepep_layout_problem(_resolve_group(ep_group)[1], num_experts, launch_ranks_per_node())

    def preprocess(self, topk_idx_TK, topk_w_TK):
        """DeepEP's layout of this routing (tokens per rank, per RDMA rank, per expert, token x rank map);
        needs the group's buffer (built by the first `dispatch`)."""
        if self.buffer is None:
            raise RuntimeError("DeepEPDispatcher.preprocess runs inside dispatch (the buffer is built there)")
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx_TK,
                                                                                         self.num_experts)
        return per_rank, per_rdma_rank, per_expert, in_rank

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        self.buffer = _buffer(self.group, x_TD.shape[1] * max(x_TD.element_size(), 2))
        per_rank, per_rdma_rank, per_expert, in_rank = self.preprocess(topk_idx_TK, topk_w_TK)
        recv_x_RD, recv_idx_RK, recv_w_RK, per_local_expert, handle_id = deepep_dispatch(
            x_TD, topk_idx_TK, topk_w_TK.float(), per_rank, per_rdma_rank, in_rank, per_expert,
            self.group.group_name)
        M = int(per_local_expert.sum())  # a CPU tensor: DeepEP's host list, no further sync
        row_M, weight_M, counts_L = local_rows_plan(recv_idx_RK, recv_w_RK, self.num_local_experts, M)
        rows = RowsState(recv_x_RD.shape[0], token_idx_N=row_M, weight_N=weight_M)
        return recv_x_RD[row_M], counts_L, DeepEPHandle(rows, handle_id, x_TD.shape[0])

    def combine(self, expert_y_MD, handle: DeepEPHandle):
        y_RD = from_expert_rows(expert_y_MD, handle.rows)  # router weights applied here, once
        return deepep_combine(y_RD, handle.handle_id, handle.num_tokens)
