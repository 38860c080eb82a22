"""The `deepep` and `hybridep` dispatchers as a plan models them, without the deep_ep package: their
exchanges at the volumes the packages move and their buffers at the sizes the packages allocate.

Legend as in `base.py`, plus P ranks in the EP group, L = E / P experts per rank, S (token, rank)
pairs this rank sends (a token goes once to each rank holding one of its experts), R pairs it
receives, C the token bound the buffers are sized by, M expert rows after the local permute.

    dispatch: counts exchanged (one host read) -> S bf16 rows, their top-k as local ids (int32) and
              weights (fp32) -> all-to-all -> R rows -> local permute -> M rows grouped by local expert
    combine:  rows scaled by the received router weights, summed per pair -> bf16 all-to-all back ->
              summed per token

Only a plan builds these (`DispatcherSpec.for_plan`, moevlm.plan.dry_run); the results equal the
`alltoall` dispatcher's up to the bf16 wire.  The buffer figures and their sources: `buffer_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moevlm.comm import all_gather_flat, all_to_all_flat
from moevlm.dispatch.alltoall import _all_to_all_rows, _resolve_group
from moevlm.dispatch.availability import (
    DEEPEP_NODE,
    deepep_rules_api,
    hybridep_domain_size,
    launch_ranks_per_node,
)
from moevlm.dispatch.base import DISPATCHERS, ModelledBuffers, TokenDispatcher, register_model
from moevlm.dispatch.capacity import expert_capacity
from moevlm.model.rows import RowsState, expert_counts, from_expert_rows, rows_plan

WIRE_DTYPE = torch.bfloat16  # both packages move 2-byte rows
TOKEN_ALIGN = 64  # HybridEP's token count, padded as moevlm.dispatch.hybridep pads it
MIB2 = 2 << 20


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# ----------------------------------------------------------------- the documented buffer sizes
# DeepEP V2 `ElasticBuffer.get_buffer_size_hint` (github.com/deepseek-ai/DeepEP, main dd758ca,
# csrc/elastic/buffer.hpp `calculate_buffer_size`, token layouts in deep_ep/include/deep_ep/common/
# layout.cuh): the larger of the dispatch and combine layouts, 2 MiB-aligned.  A token slot holds its
# row (2 bytes an element) and, 32-byte aligned, K int32 indices + K fp32 weights (+ 1 + K int32 of
# source metadata for dispatch).  Within one NVLink domain dispatch receives C slots from each of the
# P ranks and combine min(P, K) x C; across O domains of S ranks dispatch stages S x O x C + C +
# O x (C + 1280) slots and combine min(S, K) x O x C + O x (C + 1280) + min(O, K) x C (1280 = the
# kernels' channel bound, 8 per SM x 160 SMs).
V2_CHANNELS = 1280


def deepep_v2_bytes(ep: int, tokens: int, hidden: int, top_k: int, domain: int) -> int:
    """ElasticBuffer's bytes for `ep` ranks, C = `tokens`, rows of `hidden`, top-`top_k`, `domain` ranks
    per NVLink domain."""
    row = _align(hidden * 2, 32)
    dispatch_slot = row + _align(top_k * 8 + (1 + top_k) * 4, 32)
    combine_slot = row + _align(top_k * 8, 32)
    S = min(ep, domain)
    O, C = ep // S, tokens
    if O == 1:
        dispatch, combine = ep * C * dispatch_slot, min(ep, top_k) * C * combine_slot
    else:
        dispatch = (S * O * C + C + O * (C + V2_CHANNELS)) * dispatch_slot
        combine = (min(S, top_k) * O * C + O * (C + V2_CHANNELS) + min(O, top_k) * C) * combine_slot
    return _align(max(dispatch, combine), MIB2)


# DeepEP V1 `Buffer(group, num_nvl_bytes, num_rdma_bytes)` as moevlm.dispatch.deepep sizes it: the larger
# `Config.get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` (csrc/legacy/config.hpp) of
# `Buffer.get_dispatch_config(P)` and `get_combine_config(P)` (deep_ep/buffers/legacy.py: per EP size,
# (NVL send, NVL receive, RDMA send, RDMA receive) chunk tokens).  Per channel (SMs / 2) and peer a
# receive chunk of tokens, each its row, 8 bytes of source metadata and room for 128 top-k indices
# (int64), 128 weights and 128 scales (fp32); the RDMA part doubled (send and receive), 16 more bytes a
# token; 128-byte aligned.  V1 needs no token bound.
V1_CONFIGS = {  # EP size -> (dispatch, combine) configs
    2: ((24, 256, 6, 128), (10, 256, 6, 128)),
    4: ((6, 256, 6, 128), (9, 256, 6, 128)),
    8: ((6, 256, 6, 128), (4, 256, 6, 128)),
    16: ((36, 288, 20, 128), (4, 288, 12, 128)),
    24: ((32, 288, 8, 128), (1, 288, 8, 128)),
    32: ((32, 288, 8, 128), (1, 288, 8, 128)),
    48: ((32, 288, 8, 128), (1, 288, 8, 128)),
    64: ((32, 288, 8, 128), (1, 288, 8, 128)),
    96: ((20, 480, 12, 128), (1, 480, 8, 128)),
    128: ((20, 560, 12, 128), (1, 560, 8, 128)),
    144: ((32, 720, 12, 128), (2, 720, 8, 128)),
    160: ((28, 720, 12, 128), (2, 720, 8, 128)),
}
V1_DEFAULT_SMS = 20  # deep_ep.Buffer.num_sms


def deepep_v1_bytes(ep: int, hidden: int, num_sms: int = 0) -> int:
    """num_nvl_bytes + num_rdma_bytes of the V1 Buffer for `ep` ranks and bf16 rows of `hidden`."""
    channels, per_token = (num_sms or V1_DEFAULT_SMS) // 2, hidden * 2 + 8 + 128 * (8 + 4 + 4)
    nvl_peers, rdma_ranks = min(ep, DEEPEP_NODE), max(ep // DEEPEP_NODE, 1)
    nvl = rdma = 0
    for _, nvl_recv, rdma_send, rdma_recv in V1_CONFIGS[ep]:
        n = channels * nvl_peers * ((2 * rdma_ranks + 3) * 4 + nvl_recv * per_token)
        nvl = max(nvl, _align(n, 128))
        if ep > DEEPEP_NODE:
            recv = _align(rdma_recv, rdma_send)
            n = channels * rdma_ranks * 2 * ((DEEPEP_NODE * 2 + 2) * 4 + recv * (per_token + 16))
            rdma = max(rdma, _align(n, 128))
    return nvl + rdma


# HybridEP `HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts)` (DeepEP's
# hybrid-ep branch 94a9f8f, csrc/hybrid_ep/buffer/intranode.cu, NVLCoordinator::allocate_*_buffers, with
# its default use_shared_buffer=True): for N = tokens per rank x P token slots, the rows (N x hidden x 2
# bytes, shared by dispatch and combine), the probabilities (N x L x R fp32, R its ranks per NVLink
# domain) and the FP8 scaling factors (N x hidden / 128 fp32, allocated in bf16 too).  A group spanning
# several domains also holds RDMA staging buffers (internode builds): not modelled.
def hybridep_bytes(ep: int, tokens: int, hidden: int, local_experts: int, domain: int) -> int:
    N = _align(tokens, 16) * ep
    return N * hidden * 2 + N * local_experts * min(ep, domain) * 4 + N * (hidden // 128) * 4


# ----------------------------------------------------------------- the modelled dispatcher
@dataclass
class ModelledHandle:
    rows: RowsState  # the local permute: received pair and router weight of every expert row
    pair_token_S: Tensor  # source token of every pair this rank sent
    send_splits: list[int]  # pairs to each rank
    recv_splits: list[int]  # pairs from each rank
    num_tokens: int  # T on this rank
    kept: int  # expert rows that reach the experts (M, or the capacity budget when smaller)


class ModelledDispatcher(TokenDispatcher):
    """A gated backend's exchanges and buffers for a plan (module docstring): built by
    `DispatcherSpec.build` for a spec from `DispatcherSpec.for_plan`, never by a training run."""

    name = "modelled"  # replaced by the backend modelled

    @property
    def exchanges(self) -> bool:
        return self.ep_size > 1

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        buffers: ModelledBuffers,
        ep_group=None,
        etp_group=None,
        permute: str = "torch",
        api: str = "auto",
        num_sms: int = 0,
        max_tokens_per_rank: int | None = None,
        capacity_factor: float | None = None,
        capacity_overflow: str = "drop",
    ):
        """The modelled backend's (`name`) arguments are those of its real adapter, whose construction
        rules (layout, ETP, permute) it checks without the package; `buffers` holds the job's buffers."""
        super().__init__(num_experts, top_k)
        reason = DISPATCHERS[self.name].unavailable_reason(
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
        self.pool, self.api, self.num_sms = buffers, api, num_sms
        self.max_tokens_per_rank, self.capacity_factor = max_tokens_per_rank, capacity_factor

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, modelled for a plan"

    def buffer_bytes(self, num_tokens: int, hidden: int) -> int:
        raise NotImplementedError

    def _hold_buffers(self, num_tokens: int, hidden: int, device) -> None:
        """The group's buffer at its documented size, allocated once per job and grown as the package
        grows it (an uint8 tensor, so a plan's memory counts it)."""
        nbytes, key = self.buffer_bytes(num_tokens, hidden), self.group.group_name
        have = self.pool.held.get(key)
        if have is None or have.numel() < nbytes:
            self.pool.held[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _exchange_counts(
        self, in_rank_TP: Tensor, counts_E: Tensor
    ) -> tuple[list, list, Tensor, int]:
        """(pairs to each rank, pairs from each rank, rows per local expert, M): one all-to-all of
        (1 + L) ints per rank and one host read."""
        P, L = self.ep_size, self.num_local_experts
        send_PC = torch.cat([in_rank_TP.sum(0, dtype=torch.long)[:, None], counts_E.view(P, L)], 1)
        even = [1 + L] * P
        recv_PC = all_to_all_flat(send_PC.reshape(-1), even, even, self.group).view(P, 1 + L)
        host = torch.cat([send_PC[:, 0], recv_PC[:, 0], recv_PC[:, 1:].sum()[None]]).tolist()
        return host[:P], host[P : 2 * P], recv_PC[:, 1:].sum(0), host[-1]

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        T, D, P, L = topk_idx_TK.shape[0], x_TD.shape[1], self.ep_size, self.num_local_experts
        self._hold_buffers(T, D, x_TD.device)
        self._before_exchange(topk_idx_TK)
        rank_TK = topk_idx_TK // L
        in_rank_TP = torch.zeros(T, P, dtype=torch.bool, device=x_TD.device).scatter_(
            1, rank_TK, True
        )
        pair_rank_S, pair_token_S = in_rank_TP.T.nonzero(as_tuple=True)  # by rank, then token
        send, recv, counts_L, M = self._exchange_counts(
            in_rank_TP, expert_counts(topk_idx_TK, self.num_experts)
        )
        local_SK = topk_idx_TK[pair_token_S] - pair_rank_S[:, None] * L
        local_SK = torch.where((local_SK >= 0) & (local_SK < L), local_SK, -1).to(torch.int32)
        recv_RD = _all_to_all_rows(x_TD.to(WIRE_DTYPE)[pair_token_S], recv, send, self.group)
        recv_w_RK = _all_to_all_rows(topk_w_TK.float()[pair_token_S], recv, send, self.group)
        recv_idx_RK = all_to_all_flat(local_SK, recv, send, self.group).long()
        idx_RK = torch.where(recv_idx_RK >= 0, recv_idx_RK, L)
        row_N, weight_N, _ = rows_plan(idx_RK, recv_w_RK, L + 1)
        budget = self._budget(T)
        kept = M if budget is None else min(M, budget)
        rows = RowsState(sum(recv), token_idx_N=row_N[:kept], weight_N=weight_N[:kept])
        expert_x_MD = recv_RD[rows.token_idx_N].to(x_TD.dtype)
        if budget is not None:  # the static budget: padded with zero rows, the overflow dropped
            expert_x_MD = torch.cat([expert_x_MD, expert_x_MD.new_zeros(budget - kept, D)])
            counts_L = _clip_counts(counts_L, budget)
        return expert_x_MD, counts_L, ModelledHandle(rows, pair_token_S, send, recv, T, kept)

    def combine(self, expert_y_MD, handle: ModelledHandle):
        y_RD = from_expert_rows(expert_y_MD[: handle.kept], handle.rows)  # router weights, once
        back_SD = _all_to_all_rows(
            y_RD.to(WIRE_DTYPE), handle.send_splits, handle.recv_splits, self.group
        )
        return _SumRows.apply(back_SD.to(expert_y_MD.dtype), handle.pair_token_S, handle.num_tokens)

    def _before_exchange(self, topk_idx_TK: Tensor) -> None:
        """What the backend exchanges before the rows (HybridEP: its routing map)."""

    def _budget(self, num_tokens: int) -> int | None:
        """The static expert-row budget of a capacity mode, None when dropless."""
        return None


class _SumRows(torch.autograd.Function):
    """Rows summed into `num_rows` by index, as the packages' combine kernels reduce: backward keeps the
    index only (an `index_add_` would keep the rows too)."""

    @staticmethod
    def forward(ctx, rows_SD: Tensor, index_S: Tensor, num_rows: int) -> Tensor:
        ctx.save_for_backward(index_S)
        return rows_SD.new_zeros(num_rows, rows_SD.shape[1]).index_add_(0, index_S, rows_SD)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        (index_S,) = ctx.saved_tensors
        return grad_TD.index_select(0, index_S), None, None


def _clip_counts(counts_L: Tensor, budget: int) -> Tensor:
    """Rows per local expert clipped to the first `budget` rows, the unused tail the last expert's."""
    ends = torch.cumsum(counts_L, 0).clamp(max=budget)
    ends = torch.cat([ends[:-1], ends.new_full((1,), budget)])
    return torch.diff(ends, prepend=ends.new_zeros(1))


@register_model
class ModelledDeepEP(ModelledDispatcher):
    """DeepEP for a plan: V2's ElasticBuffer sized for C (the power of two at or above the token
    bound, as moevlm.dispatch.deepep grows it), or V1's Buffer with model.deepep_api=v1."""

    name = "deepep"

    def buffer_bytes(self, num_tokens: int, hidden: int) -> int:
        if deepep_rules_api(self.api, check_package=False) == "v1":
            return deepep_v1_bytes(self.ep_size, hidden, self.num_sms)
        bound = max(self.max_tokens_per_rank or num_tokens, 1)
        C = 1 << (bound - 1).bit_length()
        domain = launch_ranks_per_node() or DEEPEP_NODE
        return deepep_v2_bytes(self.ep_size, C, hidden, self.top_k, domain)


@register_model
class ModelledHybridEP(ModelledDispatcher):
    """HybridEP for a plan: its buffer for T' tokens per rank (T padded to 64, or the static bound),
    and the all-gather of the (T', E) routing map its preprocessing makes; with
    model.moe_capacity_factor the static num_permuted_tokens budget of moevlm.dispatch.hybridep."""

    name = "hybridep"

    def padded_tokens(self, num_tokens: int) -> int:
        return _align(self.max_tokens_per_rank or num_tokens, TOKEN_ALIGN)

    def buffer_bytes(self, num_tokens: int, hidden: int) -> int:
        T_pad, L = self.padded_tokens(num_tokens), self.num_local_experts
        return hybridep_bytes(self.ep_size, T_pad, hidden, L, hybridep_domain_size())

    def _before_exchange(self, topk_idx_TK: Tensor) -> None:
        T, E = topk_idx_TK.shape[0], self.num_experts
        map_TE = torch.zeros(self.padded_tokens(T), E, dtype=torch.bool, device=topk_idx_TK.device)
        map_TE[:T].scatter_(1, topk_idx_TK, True)
        all_gather_flat(map_TE.view(torch.uint8), self.group)  # a byte per entry, as HybridEP's

    def _budget(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        C = expert_capacity(self.capacity_factor, num_tokens, self.top_k, self.num_experts)
        return self.num_experts * C


__all__ = [
    "ModelledDeepEP",
    "ModelledDispatcher",
    "ModelledHybridEP",
    "deepep_v1_bytes",
    "deepep_v2_bytes",
    "hybridep_bytes",
]
