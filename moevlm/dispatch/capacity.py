"""Capacity-bounded all-to-all (`model.moe_capacity_factor`): fixed-size buffers, no host read,
overflow dropped and counted; `AllToAllDispatcher` runs it when built with a `capacity_factor`.
Its index logic and the trainer's `OverflowCounter`; why: docs/dispatchers.md.

Legend as in `alltoall.py`: T tokens on this rank, K top-k, D hidden, E experts, P ranks in the EP
group, L = E / P local experts, N = T*K rows, C the capacity, S = E*C send slots.

    C = ceil(capacity_factor * T * K / E)   rows per (source rank, expert)
    dispatch: rows sorted by expert; a row at position >= C within its expert is dropped, the others
              fill slot e*C + position of a fixed (S, D) buffer -> all-to-all, [L*C] * P both ways
    combine:  reverse all-to-all -> each kept row reads its slot, a dropped row zero -> scale by
              router weight -> `index_add_` per token
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

OVERFLOW_POLICIES = ("drop", "error")


class CapacityOverflowError(RuntimeError):
    """model.moe_capacity_overflow=error and some (token, expert) choice went over the capacity."""


def expert_capacity(capacity_factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """C = ceil(capacity_factor * T * K / E), from host numbers only."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def capacity_slots(
    counts_E: torch.Tensor, num_rows: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the N rows sorted by expert (`counts_E` rows per expert): each row's send slot
    (expert * C + position within its expert) and whether it is kept (position < C);
    dropped rows get the slot S = E*C (one past the buffer)."""
    E = counts_E.shape[0]
    expert_N = torch.repeat_interleave(
        torch.arange(E, device=counts_E.device), counts_E, output_size=num_rows
    )
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos_N = torch.arange(num_rows, device=counts_E.device) - start_E[expert_N]
    keep_N = pos_N < capacity
    return torch.where(keep_N, expert_N * capacity + pos_N, E * capacity), keep_N


def slot_sources(
    slot_N: torch.Tensor, token_idx_N: torch.Tensor, num_slots: int, num_tokens: int
) -> torch.Tensor:
    """The source token of every send slot, `num_tokens` (a zero row) where no row fills it."""
    src = torch.full((num_slots + 1,), num_tokens, dtype=torch.long, device=slot_N.device)
    # (dropped rows all land in the cut-off slot)
    return src.scatter_(0, slot_N, token_idx_N)[:num_slots]


def in_backward() -> bool:
    """True while the autograd engine runs (activation recompute re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


def add_overflow(dispatcher, dropped: torch.Tensor, flagged: torch.Tensor, routed: int) -> None:
    """Add one dispatch's dropped rows and whether it overflowed (device tensors: no sync) and its routed
    rows to `dispatcher`'s counters, which `OverflowCounter` reads."""
    d = dispatcher
    d.dropped = dropped if d.dropped is None else d.dropped + dropped
    d.flagged = flagged if d.flagged is None else d.flagged + flagged
    d.routed += routed


class OverflowCounter:
    """The trainer's view of the capacity dispatchers of a model: dropped and routed rows,
    summed over layers, micro-batches and `groups` (ranks holding different tokens).  Every
    rank of those groups must call `totals` together (even one without MoE layers)."""

    def __init__(self, model: torch.nn.Module, groups: list, capacity_factor: float, overflow: str):
        self.dispatchers = [
            m.dispatcher
            for m in model.modules()
            if getattr(getattr(m, "dispatcher", None), "capacity_factor", None) is not None
        ]
        self.groups = [g for g in groups if g is not None]
        self.capacity_factor, self.overflow = capacity_factor, overflow

    def totals(self, device: torch.device, reset: bool) -> tuple[int, int, int]:
        """(dropped rows, routed rows, dispatches that overflowed): one host read."""
        t = torch.zeros(3, dtype=torch.long, device=device)
        for d in self.dispatchers:
            if d.dropped is not None:
                t[0] += d.dropped.to(device)
                t[2] += d.flagged.to(device)
            t[1] += d.routed
            if reset:
                d.dropped, d.flagged, d.routed = None, None, 0
        for g in self.groups:
            dist.all_reduce(t, group=g)
        dropped, routed, flagged = t.tolist()
        return dropped, routed, flagged

    def check(self, device: torch.device, step: int) -> None:
        """model.moe_capacity_overflow=error: raise (on every rank alike) when anything was dropped."""
        dropped, routed, _ = self.totals(device, reset=False)
        if dropped:
            raise CapacityOverflowError(
                f"step {step}: {dropped} of {routed} routed (token, expert) choices went over the expert capacity "
                f"(model.moe_capacity_factor={self.capacity_factor:g}, model.moe_capacity_overflow=error); raise "
                "model.moe_capacity_factor, set it to null for the dropless all-to-all, or set "
                "model.moe_capacity_overflow=drop to drop and count them"
            )

    def record(self, device: torch.device) -> dict:
        dropped, routed, flagged = self.totals(device, reset=True)
        return {
            "moe_dropped_tokens": dropped,
            "moe_dropped_fraction": dropped / routed if routed else None,
            "moe_overflowed_dispatches": flagged,
        }
