"""The all-to-all dispatcher: expert parallel over an EP process group, with expert tensor parallel
(ETP) over a second group, dropless; or, built with a `capacity_factor`, capacity-bounded with
fixed-size buffers and no host read (capacity.py; EP only).  Why: docs/dispatchers.md.

Legend as in `base.py`, plus P ranks in the EP group, L = E / P experts per rank (rank r owns
experts [r*L, (r+1)*L)), N = T*K rows this rank sends, M rows it receives, Q ranks in the ETP group
(the same experts, each a 1/Q slice of the expert hidden dimension, different tokens).

    dispatch: sort the N rows by expert -> exchange per-expert counts (the one host read) -> uneven
              all-to-all of the rows -> ETP: all-gather over the ETP group -> regroup expert-major
    combine:  inverse regroup -> ETP: reduce-scatter -> reverse all-to-all -> scale by router weight
              -> sum the K rows of every token (`index_add_`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moevlm.comm import all_gather_flat, all_to_all_flat
from moevlm.dispatch.base import TokenDispatcher, register_dispatcher
from moevlm.dispatch.capacity import (
    OVERFLOW_POLICIES,
    add_overflow,
    capacity_slots,
    expert_capacity,
    in_backward,
    slot_sources,
)
from moevlm.model.rows import (
    RowsState,
    from_expert_rows,
    rows_plan,
    sort_rows_by_expert,
    to_expert_rows,
)  # noqa: F401

# ----------------------------------------------------------------- pure index logic


def rank_splits(counts_E: list[int], ep_size: int) -> list[int]:
    """Rows per rank, given rows per expert (experts split evenly, in rank order)."""
    per_rank = len(counts_E) // ep_size
    return [sum(counts_E[p * per_rank : (p + 1) * per_rank]) for p in range(ep_size)]


def regroup_by_local_expert(
    recv_counts_PL: torch.Tensor, num_rows: int | None = None
) -> torch.Tensor:
    """Permutation `perm_M` with `grouped = received[perm_M]`.

    `received` holds blocks (source p, local expert l) in p-major order with
    `recv_counts_PL[p, l]` rows each; `grouped` holds them l-major (then p, then the
    order within the block).  `num_rows` (= recv_counts_PL.sum()) avoids a sync."""
    P, L = recv_counts_PL.shape
    block_B = torch.arange(P * L, device=recv_counts_PL.device)
    block_M = torch.repeat_interleave(block_B, recv_counts_PL.reshape(-1), output_size=num_rows)
    expert_major_key_M = (block_M % L) * P + block_M // L
    return torch.sort(expert_major_key_M, stable=True).indices


def invert_permutation(perm_M: torch.Tensor) -> torch.Tensor:
    inv_M = torch.empty_like(perm_M)
    inv_M[perm_M] = torch.arange(perm_M.numel(), device=perm_M.device)
    return inv_M


def divisibility_reason(num_experts: int, ep_size: int) -> str | None:
    if num_experts % ep_size == 0:
        return None
    return (
        f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}; "
        f"choose an EP size that divides {num_experts}, or a number of experts that is a multiple of {ep_size}"
    )


# ----------------------------------------------------------------- process group


def _resolve_group(ep_group) -> tuple[object | None, int, int]:
    """(group, size, my index) — None/1/0 when there is no distributed run."""
    if ep_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        ep_group = dist.group.WORLD
    return ep_group, dist.get_world_size(ep_group), dist.get_rank(ep_group)


def _all_to_all_rows(
    rows_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group
) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    # The result may be an AsyncCollectiveTensor: it waits on its first use.
    return all_to_all_single_autograd(rows_ND.contiguous(), out_splits, in_splits, group)


@dataclass
class ExchangePlan:
    send_splits: list[int]  # rows to each rank of the EP group (P ints)
    recv_splits: list[int]  # rows from each rank of the EP group (P ints)
    # rows each rank of the ETP group received over EP (Q ints; [M] without ETP)
    etp_splits: list[int]
    regroup_M: torch.Tensor  # grouped = received[regroup_M]
    ungroup_M: torch.Tensor  # received = grouped[ungroup_M]
    tokens_per_local_expert_L: torch.Tensor


@dataclass
class AllToAllHandle:
    rows: RowsState  # this rank's permutation of its own tokens (sorted by expert)
    plan: ExchangePlan | None  # None at EP size 1


@dataclass
class CapacityHandle:
    rows: RowsState  # this rank's rows sorted by expert: source token and router weight of each
    slot_N: torch.Tensor  # each row's send slot; E*C (past the buffer) for a dropped row
    capacity: int


@register_dispatcher
class AllToAllDispatcher(TokenDispatcher):
    name = "alltoall"
    overlappable = True  # moevlm.parallel.ep_overlap drives its pieces chunk by chunk

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ep_group=None,
        etp_group=None,
        always_exchange: bool = False,
        permute: str = "torch",
        capacity_factor: float | None = None,
        capacity_overflow: str = "drop",
    ):
        """`always_exchange` runs the exchange path (counts, host sync, all-to-all,
        regroup) even over a group of one: for measuring its cost on one GPU.
        `permute` is the local permutation's backend (moevlm.model.rows).
        `capacity_factor` (None = dropless) selects the capacity mode (capacity.py); `capacity_overflow`
        is read by the trainer (drop: count; error: the step fails)."""
        super().__init__(num_experts, top_k)
        self.always_exchange, self.permute = always_exchange, permute
        self.group, self.ep_size, self.ep_rank = _resolve_group(ep_group)
        self.etp_group, self.etp_size = (
            etp_group,
            1 if etp_group is None else dist.get_world_size(etp_group),
        )
        reason = divisibility_reason(num_experts, self.ep_size)
        if reason is not None:
            raise ValueError(reason)
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor, self.capacity_overflow = capacity_factor, capacity_overflow
        # capacity mode: dropped rows and dispatches that dropped any (device tensors), routed rows
        self.dropped, self.flagged, self.routed = None, None, 0
        if capacity_factor is not None:
            _check_capacity(capacity_factor, capacity_overflow, self.etp_size)

    @classmethod
    def unavailable_reason(cls, num_experts: int, ep_group=None, **kwargs) -> str | None:
        return divisibility_reason(num_experts, _resolve_group(ep_group)[1])

    @property
    def exchanges(self) -> bool:
        return self.ep_size > 1 or self.etp_size > 1 or self.always_exchange

    @property
    def capturable_preprocess(self) -> bool:
        return self.permute == "torch"

    def preprocess(self, topk_idx_TK, topk_w_TK):
        """The local sort before the counts exchange (the host sync comes after it)."""
        return (
            rows_plan(topk_idx_TK, topk_w_TK, self.num_experts) if self.permute == "torch" else None
        )

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        if self.capacity_factor is not None:
            return self._dispatch_capacity(x_TD, topk_idx_TK, topk_w_TK)
        rows_ND, counts_E, rows = to_expert_rows(
            x_TD,
            topk_idx_TK,
            topk_w_TK,
            self.num_experts,
            self.permute,
            plan=self.planned(topk_idx_TK, topk_w_TK),
        )
        if self.ep_size == 1 and self.etp_size == 1 and not self.always_exchange:
            return rows_ND, counts_E, AllToAllHandle(rows, None)
        plan = self._plan(counts_E)
        recv_MD = rows_ND
        if self.ep_size > 1 or self.always_exchange:
            recv_MD = _all_to_all_rows(rows_ND, plan.recv_splits, plan.send_splits, self.group)
        if self.etp_size > 1:
            mine = sum(plan.recv_splits)
            recv_MD = _all_to_all_rows(
                recv_MD.repeat(self.etp_size, 1),
                plan.etp_splits,
                [mine] * self.etp_size,
                self.etp_group,
            )
        handle = AllToAllHandle(rows, plan)
        return recv_MD[plan.regroup_M], plan.tokens_per_local_expert_L, handle

    def _plan(self, counts_E: torch.Tensor) -> ExchangePlan:
        """Exchange the per-expert counts; the one host sync of a dispatch."""
        P, L, Q = self.ep_size, self.num_local_experts, self.etp_size
        recv_counts_E = counts_E
        if P > 1 or self.always_exchange:
            even = [L] * P  # block p: from rank p, my L experts
            recv_counts_E = all_to_all_flat(counts_E, even, even, self.group)
        all_counts_E = recv_counts_E  # Q blocks of (P, L) after the ETP gather
        if Q > 1:
            all_counts_E = all_gather_flat(recv_counts_E, self.etp_group)
        host = torch.cat([counts_E, all_counts_E]).tolist()
        send_splits = rank_splits(host[: P * L], P)
        # what this rank got over EP
        mine = host[P * L :][self.etp_rank * P * L : (self.etp_rank + 1) * P * L]
        recv_splits = rank_splits(mine, P)
        etp_splits = rank_splits(host[P * L :], Q)
        blocks_BL = all_counts_E.view(Q * P, L)
        regroup_M = regroup_by_local_expert(blocks_BL, sum(etp_splits))
        return ExchangePlan(
            send_splits,
            recv_splits,
            etp_splits,
            regroup_M,
            invert_permutation(regroup_M),
            blocks_BL.sum(0),
        )

    @property
    def etp_rank(self) -> int:
        return 0 if self.etp_group is None else dist.get_rank(self.etp_group)

    # ----------------------------------------------------------- capacity mode (capacity.py)
    def _exchanges(self) -> bool:
        return self.ep_size > 1 or self.always_exchange

    def _dispatch_capacity(self, x_TD, topk_idx_TK, topk_w_TK):
        """Fixed-size buffers: every split is a Python int from shapes; nothing reads a tensor on the host."""
        send_SD, handle = self.capacity_send(x_TD, topk_idx_TK, topk_w_TK)
        splits = self.capacity_splits(handle.capacity)
        recv_SD = (
            _all_to_all_rows(send_SD, splits, splits, self.group) if self._exchanges() else send_SD
        )
        return (
            self.capacity_grouped(recv_SD, handle.capacity),
            self.capacity_tokens_per_local_expert(handle.capacity, x_TD.device),
            handle,
        )

    def _combine_capacity(self, expert_y_MD, handle: CapacityHandle):
        y_SD = self.capacity_ungrouped(expert_y_MD, handle.capacity)
        if self._exchanges():
            splits = self.capacity_splits(handle.capacity)
            y_SD = _all_to_all_rows(y_SD, splits, splits, self.group)
        return self.capacity_unslot(y_SD, handle)

    # the capacity mode's steps around its two exchanges (also run chunk by chunk: moevlm.parallel.ep_overlap)
    def capacity_send(self, x_TD, topk_idx_TK, topk_w_TK) -> tuple[torch.Tensor, CapacityHandle]:
        """This rank's (E*C, D) send buffer (expert e's kept rows at slots e*C.., unfilled slots zero), and the
        handle that brings the rows back; dropped rows counted."""
        (T, K), D = topk_idx_TK.shape, x_TD.shape[1]
        E = self.num_experts
        C = expert_capacity(self.capacity_factor, T, K, E)
        plan = self.planned(topk_idx_TK, topk_w_TK) or rows_plan(topk_idx_TK, topk_w_TK, E)
        token_idx_N, weight_N, counts_E = plan
        slot_N, keep_N = capacity_slots(counts_E, T * K, C)
        self._count(keep_N)
        send_SD = torch.cat([x_TD, x_TD.new_zeros(1, D)])[
            slot_sources(slot_N, token_idx_N, E * C, T)
        ]
        return send_SD, CapacityHandle(
            RowsState(T, token_idx_N=token_idx_N, weight_N=weight_N), slot_N, C
        )

    def capacity_splits(self, capacity: int) -> list[int]:
        """Every exchange's split sizes: L*C rows to and from each rank."""
        return [self.num_local_experts * capacity] * self.ep_size

    def capacity_grouped(self, recv_SD, capacity: int) -> torch.Tensor:
        """Received (P, L, C) blocks -> rows grouped by local expert (P*C each, padding included)."""
        P, L, D = self.ep_size, self.num_local_experts, recv_SD.shape[1]
        return recv_SD.view(P, L, capacity, D).transpose(0, 1).reshape(L * P * capacity, D)

    def capacity_ungrouped(self, expert_y_MD, capacity: int) -> torch.Tensor:
        """The inverse of `capacity_grouped`: the (P, L, C) blocks to send back."""
        P, L, D = self.ep_size, self.num_local_experts, expert_y_MD.shape[1]
        return expert_y_MD.view(L, P, capacity, D).transpose(0, 1).reshape(P * L * capacity, D)

    def capacity_tokens_per_local_expert(self, capacity: int, device) -> torch.Tensor:
        return torch.full(
            (self.num_local_experts,), self.ep_size * capacity, dtype=torch.long, device=device
        )

    @staticmethod
    def capacity_unslot(y_SD, handle: CapacityHandle) -> torch.Tensor:
        """The returned slots -> per token: each kept row reads its slot, a dropped row zero, then weighted."""
        y_ND = torch.cat([y_SD, y_SD.new_zeros(1, y_SD.shape[1])])[handle.slot_N]
        return from_expert_rows(y_ND, handle.rows)

    def _count(self, keep_N: torch.Tensor) -> None:
        """Dropped rows added on the device (no sync); a recompute re-run in backward is not counted again."""
        if in_backward():
            return
        dropped = keep_N.numel() - keep_N.sum()
        add_overflow(self, dropped, (dropped > 0).long(), keep_N.numel())

    def combine(self, expert_y_MD, handle: AllToAllHandle):
        if isinstance(handle, CapacityHandle):
            return self._combine_capacity(expert_y_MD, handle)
        y_ND = expert_y_MD
        if handle.plan is not None:
            plan = handle.plan
            y_ND = expert_y_MD[plan.ungroup_M]
            if self.etp_size > 1:
                mine = sum(plan.recv_splits)
                y_ND = _all_to_all_rows(
                    y_ND, [mine] * self.etp_size, plan.etp_splits, self.etp_group
                )
                y_ND = y_ND.view(self.etp_size, mine, -1).sum(0)
            if self.ep_size > 1 or self.always_exchange:
                y_ND = _all_to_all_rows(y_ND, plan.send_splits, plan.recv_splits, self.group)
        return from_expert_rows(y_ND, handle.rows)


def _check_capacity(capacity_factor, overflow: str, etp_size: int) -> None:
    if not (
        isinstance(capacity_factor, (int, float))
        and not isinstance(capacity_factor, bool)
        and math.isfinite(capacity_factor)
        and capacity_factor > 0
    ):
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be a finite number > 0 (None: dropless)"
        )
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"capacity_overflow={overflow!r}; choose one of {list(OVERFLOW_POLICIES)}")
    if etp_size > 1:
        raise ValueError(
            f"the capacity all-to-all is not built for expert tensor parallel (etp={etp_size}); use "
            "parallel.etp=1 or model.moe_capacity_factor=null (dropless)"
        )
