"""Expert-parallel exchanges overlapped with expert compute (`parallel.ep_overlap=true`).

Legend as in moevlm/dispatch/alltoall.py: T tokens on this rank, K top-k, D hidden, E experts,
P ranks in the EP group, L = E / P local experts, M rows received; c a chunk (0 or 1).

A block's micro-batch is routed once, whole, then cut in two chunks (T0 = ceil(T/2), T1 = T - T0);
each chunk's exchanges (dispatch dc, combine cc) overlap the other's experts (docs/architecture.md):

    forward:  start d0, start d1 | finish d0, experts 0, start c0 | finish d1, experts 1, start c1
              | finish c0, finish c1
    backward: issue c1, issue c0 | wait c1, experts 1, issue d1 | wait c0, experts 0, issue d0
              | wait d1, wait d0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from moevlm.comm import all_to_all_flat
from moevlm.dispatch.alltoall import (
    AllToAllDispatcher,
    CapacityHandle,
    invert_permutation,
    rank_splits,
    regroup_by_local_expert,
)
from moevlm.model.rows import RowsState, from_expert_rows, rows_plan, to_expert_rows

CHUNKS = 2


class _Exchange:
    """One all-to-all of rows, split into two autograd nodes so that both its forward and its backward
    exchange run while other work does:

        out = ex.start(rows)     # issued, not waited: `out` is not valid yet, only `finish` may read it
        ...                      # other work
        rows_out = ex.finish(out)

    Backward: `finish`'s issues the reverse all-to-all of the gradient; `start`'s waits for it."""

    def __init__(self, group, out_splits: list[int], in_splits: list[int], what: str = ""):
        self.group, self.out_splits, self.in_splits, self.what = group, out_splits, in_splits, what
        # the exchange in flight (None once waited), its send buffer; the same for the gradient's
        self.work = self.src = self.grad_work = self.grad_in = self.grad_src = None

    def start(self, rows: torch.Tensor) -> torch.Tensor:
        return _Start.apply(rows, self)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return _Finish.apply(out, self)


def _issue(group, src: torch.Tensor, out_splits: list[int], in_splits: list[int]):
    src = src.contiguous()
    out = src.new_empty(sum(out_splits), *src.shape[1:])
    return (
        out,
        src,
        dist.all_to_all_single(out, src, out_splits, in_splits, group=group, async_op=True),
    )


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, ex: _Exchange):
        ctx.ex = ex
        out, ex.src, ex.work = _issue(ex.group, rows, ex.out_splits, ex.in_splits)
        return out

    @staticmethod
    def backward(ctx, _unused):
        """The end of the reverse exchange `_Finish.backward` issued: the gradient of the sent rows."""
        ex = ctx.ex
        ex.grad_work.wait()
        grad, ex.grad_in, ex.grad_src, ex.grad_work = ex.grad_in, None, None, None
        return grad, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, ex: _Exchange):
        ctx.ex = ex
        ex.work.wait()
        ex.work, ex.src = None, None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        """Issue the reverse exchange of the gradient (not waited: `_Start.backward` waits); the gradient
        handed on is a placeholder of the right shape that `_Start.backward` does not read."""
        ex = ctx.ex
        ex.grad_in, ex.grad_src, ex.grad_work = _issue(ex.group, grad, ex.in_splits, ex.out_splits)
        return grad, None


@dataclass
class _Chunk:
    """One chunk in flight: its rows state, its exchange splits and permutations, and the pending rows."""

    rows: RowsState
    send_splits: list[int]
    recv_splits: list[int]
    regroup_M: torch.Tensor | None  # dropless: grouped = received[regroup_M]; None in capacity mode
    tokens_per_local_expert_L: torch.Tensor
    exchange: _Exchange  # the dispatch all-to-all, then the combine's
    pending: torch.Tensor  # its output, valid after `exchange.finish`
    capacity_handle: CapacityHandle | None = None  # capacity mode: the dispatcher's handle


def chunk_bounds(num_tokens: int, chunks: int = CHUNKS) -> list[tuple[int, int]]:
    """[start, end) of each chunk: sizes differ by at most one, the first ones larger."""
    base, extra = divmod(num_tokens, chunks)
    sizes = [base + (c < extra) for c in range(chunks)]
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


class OverlappedRunner(nn.Module):
    """The experts runner of the overlapped forward above; `dispatcher` must be an overlappable one (the
    `alltoall` dispatcher over an EP group, etp 1: the build checks `problem`)."""

    def forward(self, x_TD, topk_idx_TK, topk_w_TK, d: AllToAllDispatcher, experts) -> torch.Tensor:
        bounds = chunk_bounds(x_TD.shape[0])
        parts = [(x_TD[a:b], topk_idx_TK[a:b], topk_w_TK[a:b]) for a, b in bounds]
        if d.capacity_factor is None:
            chunks = _dispatch_dropless(d, parts)
        else:
            chunks = [_dispatch_capacity(d, c, *p) for c, p in enumerate(parts)]
        # chunk c's experts run while chunk c+1's dispatch (and c-1's combine) travel
        for c, ch in enumerate(chunks):
            expert_y_MD = experts(_grouped(d, ch), ch.tokens_per_local_expert_L)
            _combine_start(d, ch, expert_y_MD, c)
        return torch.cat([_combine_finish(d, ch) for ch in chunks])


# ----------------------------------------------------------------- dropless


def _dispatch_dropless(d: AllToAllDispatcher, parts) -> list[_Chunk]:
    """Permute every chunk, exchange all chunks' counts at once (the one host sync), issue every chunk's rows."""
    P, L = d.ep_size, d.num_local_experts
    permuted = [
        to_expert_rows(
            x,
            idx,
            w,
            d.num_experts,
            d.permute,
            plan=rows_plan(idx, w, d.num_experts) if d.permute == "torch" else None,
        )
        for x, idx, w in parts
    ]
    counts_CE = torch.stack([counts_E for _, counts_E, _ in permuted])
    C = counts_CE.shape[0]
    # block p: every chunk's counts for rank p
    send_PCL = counts_CE.view(C, P, L).transpose(0, 1).contiguous()
    recv_PCL = all_to_all_flat(send_PCL.view(-1), [C * L] * P, [C * L] * P, d.group).view(P, C, L)
    host = torch.cat([counts_CE.view(-1), recv_PCL.view(-1)]).tolist()
    sent, got = host[: C * P * L], host[C * P * L :]
    chunks = []
    for c, (rows_ND, _, rows) in enumerate(permuted):
        recv_PL = recv_PCL[:, c]
        got_PL = [got[(p * C + c) * L : (p * C + c + 1) * L] for p in range(P)]
        recv_splits = [sum(g) for g in got_PL]
        send_splits = rank_splits(sent[c * P * L : (c + 1) * P * L], P)
        regroup_M = regroup_by_local_expert(recv_PL, sum(recv_splits))
        exchange = _Exchange(d.group, recv_splits, send_splits, f"dispatch {c}")
        chunks.append(
            _Chunk(
                rows,
                send_splits,
                recv_splits,
                regroup_M,
                recv_PL.sum(0),
                exchange,
                exchange.start(rows_ND),
            )
        )
    return chunks


# ----------------------------------------------------------------- capacity


def _dispatch_capacity(d: AllToAllDispatcher, c: int, x_TD, topk_idx_TK, topk_w_TK) -> _Chunk:
    """The capacity dispatch of `AllToAllDispatcher` for chunk c, its capacity from the chunk's T."""
    send_SD, handle = d.capacity_send(x_TD, topk_idx_TK, topk_w_TK)
    splits = d.capacity_splits(handle.capacity)
    exchange = _Exchange(d.group, splits, splits, f"dispatch {c}")
    tokens_L = d.capacity_tokens_per_local_expert(handle.capacity, x_TD.device)
    return _Chunk(
        handle.rows, splits, splits, None, tokens_L, exchange, exchange.start(send_SD), handle
    )


# ----------------------------------------------------------------- both modes


def _grouped(d: AllToAllDispatcher, ch: _Chunk) -> torch.Tensor:
    """The chunk's received rows grouped by local expert (waits for its dispatch)."""
    received = ch.exchange.finish(ch.pending)
    if ch.regroup_M is not None:
        return received[ch.regroup_M]
    return d.capacity_grouped(received, ch.capacity_handle.capacity)


def _combine_start(d: AllToAllDispatcher, ch: _Chunk, expert_y_MD: torch.Tensor, c: int) -> None:
    """Issue the chunk's return all-to-all (not waited)."""
    if ch.regroup_M is not None:
        y_ND = expert_y_MD[invert_permutation(ch.regroup_M)]
    else:
        y_ND = d.capacity_ungrouped(expert_y_MD, ch.capacity_handle.capacity)
    ch.exchange = _Exchange(d.group, ch.send_splits, ch.recv_splits, f"combine {c}")
    ch.pending = ch.exchange.start(y_ND)


def _combine_finish(d: AllToAllDispatcher, ch: _Chunk) -> torch.Tensor:
    """Wait for the chunk's return rows; weight and sum them per token."""
    returned = ch.exchange.finish(ch.pending)
    if ch.capacity_handle is not None:
        return d.capacity_unslot(returned, ch.capacity_handle)  # a dropped row reads zero
    return from_expert_rows(returned, ch.rows)


# ----------------------------------------------------------------- checking it
def problem(dispatcher) -> str | None:
    """Why a block with this dispatcher cannot run the overlapped forward, or None."""
    if not dispatcher.overlappable:
        return f"parallel.ep_overlap needs the alltoall dispatcher, not {type(dispatcher).__name__}"
    if dispatcher.etp_size > 1:
        return f"parallel.ep_overlap is not built for expert tensor parallel (etp={dispatcher.etp_size})"
    if dispatcher.ep_size == 1:
        return "parallel.ep_overlap needs parallel.ep > 1 (nothing to overlap within one rank)"
    return None


__all__ = ["CHUNKS", "OverlappedRunner", "chunk_bounds", "problem"]
