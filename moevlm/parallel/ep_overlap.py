"""Expert-parallel communication overlapped with expert compute (`parallel.ep_overlap=true`).

Legend as in moevlm/dispatch/alltoall.py: T tokens on this rank, K top-k, D hidden, E experts,
P ranks in the EP group, L = E / P local experts, M rows received; c the chunk (0 or 1).

Each MoE block's micro-batch is routed once, whole, then its tokens are cut in two chunks
(T0 = ceil(T/2) tokens, T1 = T - T0) that go through the exchange one after the other:

    route all T tokens (router, aux-loss statistics over the whole micro-batch)
    chunk 0: permute, dispatch all-to-all issued          chunk 1: permute, dispatch issued
    wait dispatch 0 -> experts(chunk 0)                    ... dispatch 1 in flight ...
    combine all-to-all 0 issued
    wait dispatch 1 -> experts(chunk 1)                    ... combine 0 in flight ...
    combine all-to-all 1 issued
    wait combine 0, combine 1 -> weighted sum per token -> concatenate the chunks

Design choices:
- A wrapper of `MoEBlock.forward` (the block's class swapped for a subclass that adds the
  overlapped forward, so the TP/CP `SPMoEBlock` statistics keep working); the model knows
  nothing of it.  Applied in `parallelize` after expert parallel, before recompute.
- It drives the `alltoall` dispatcher's pieces (its permutation, its exchange plan's pure
  index functions, its row all-to-all) instead of calling `dispatch`/`combine`, because those
  wait on their exchange at once.  The rows travel by `all_to_all_single_autograd` (functional
  collectives): it returns an `AsyncCollectiveTensor` that waits on its first use, so an
  exchange runs (on NCCL's stream, on gloo's worker thread) while the other chunk's experts
  compute.  Every rank issues the same collectives in the same order (the chunk sizes come
  from T, the splits from the exchanged counts), so nothing can deadlock.
- Dropless: **one** counts exchange and **one** host sync per block for both chunks (the
  counts of chunk 0 and 1 travel in one all_to_all of 2*E ints), i.e. no extra sync compared
  with the non-overlapped path.
- Capacity mode (`model.moe_capacity_factor`): each chunk has its own capacity,
  C_c = ceil(f * T_c * K / E), from its own token count: every split is still a host number.
  Which choices are dropped can therefore differ from the non-overlapped run (there the first
  C rows of an expert over the whole micro-batch are kept; here the first C_c of each chunk).
  Without overflow (e.g. f >= E/K) the result is the same.
- Exactness: a token's K rows stay in one chunk and are summed in the same order (expert
  order) as without overlap, so the output is the same function; only the expert-weight
  gradients are summed over the chunks in another order (fp32 rounding, ~1e-7 relative).
- Router statistics and routing come from one router call on all tokens, exactly as without
  overlap (the router is per token, so chunking could not change a decision anyway).
- Backward: autograd through the same collectives (their backward is the reverse
  all-to-all, waited before use), in the engine's order, which is the same on every rank;
  the backward exchanges are not overlapped by this module.
- Not built: expert tensor parallel (etp > 1), the dispatcher's compile wrapping
  (train.compile), the CUDA-graphed `moe_preprocess` (it captures one static shape); the
  config refuses those (moevlm/train/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from moevlm.dispatch.alltoall import (
    AllToAllDispatcher,
    CapacityHandle,
    _all_to_all_rows,
    all_to_all_flat,
    invert_permutation,
    rank_splits,
    regroup_by_local_expert,
)
from moevlm.dispatch.rows import RowsState, from_expert_rows, rows_plan, to_expert_rows
from moevlm.model.moe import MoEBlock

CHUNKS = 2


@dataclass
class _Chunk:
    """One chunk in flight: its rows state, its exchange splits and permutations, and the pending rows."""
    rows: RowsState
    send_splits: list[int]
    recv_splits: list[int]
    regroup_M: torch.Tensor | None  # dropless: grouped = received[regroup_M]; None in capacity mode
    tokens_per_local_expert_L: torch.Tensor
    pending: torch.Tensor  # the dispatch all-to-all's output, then the combine's (waits on first use)
    capacity_handle: CapacityHandle | None = None  # capacity mode: the dispatcher's handle


def chunk_bounds(num_tokens: int, chunks: int = CHUNKS) -> list[tuple[int, int]]:
    """[start, end) of each chunk: sizes differ by at most one, the first ones larger."""
    base, extra = divmod(num_tokens, chunks)
    sizes = [base + (c < extra) for c in range(chunks)]
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


class OverlappedMoE:
    """Mixin before a `MoEBlock` class: the forward above.  `dispatcher` must be an `AllToAllDispatcher`
    over an EP group (etp 1)."""

    def forward(self, x_BSD: torch.Tensor, token_mask_BS: torch.Tensor | None = None):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        topk_idx_TK, topk_w_TK, probs_TE = self.router(x_TD)
        d: AllToAllDispatcher = self.dispatcher
        bounds = chunk_bounds(x_TD.shape[0])
        parts = [(x_TD[a:b], topk_idx_TK[a:b], topk_w_TK[a:b]) for a, b in bounds]
        if d.capacity_factor is None:
            chunks = _dispatch_dropless(d, parts)
        else:
            chunks = [_dispatch_capacity(d, *p) for p in parts]
        for ch in chunks:  # chunk c's experts run while chunk c+1's dispatch (and c-1's combine) travel
            expert_y_MD = self.experts(_grouped(d, ch), ch.tokens_per_local_expert_L)
            ch.pending = _combine_start(d, ch, expert_y_MD)
        y_TD = torch.cat([_combine_finish(d, ch) for ch in chunks])
        return y_TD.view_as(x_BSD), self._stats(topk_idx_TK, probs_TE, token_mask_BS)


# ----------------------------------------------------------------- dropless


def _dispatch_dropless(d: AllToAllDispatcher, parts) -> list[_Chunk]:
    """Permute every chunk, exchange all chunks' counts at once (the one host sync), issue every chunk's rows."""
    P, L = d.ep_size, d.num_local_experts
    permuted = [to_expert_rows(x, idx, w, d.num_experts, d.permute,
                               plan=rows_plan(idx, w, d.num_experts) if d.permute == "torch" else None)
                for x, idx, w in parts]
    counts_CE = torch.stack([counts_E for _, counts_E, _ in permuted])
    C = counts_CE.shape[0]
    send_PCL = counts_CE.view(C, P, L).transpose(0, 1).contiguous()  # block p: every chunk's counts for rank p
    recv_PCL = all_to_all_flat(send_PCL.view(-1), [C * L] * P, [C * L] * P, d.group).view(P, C, L)
    host = torch.cat([counts_CE.view(-1), recv_PCL.view(-1)]).tolist()
    sent, got = host[:C * P * L], host[C * P * L:]
    chunks = []
    for c, (rows_ND, _, rows) in enumerate(permuted):
        recv_PL = recv_PCL[:, c]
        got_PL = [got[(p * C + c) * L:(p * C + c + 1) * L] for p in range(P)]
        recv_splits = [sum(g) for g in got_PL]
        send_splits = rank_splits(sent[c * P * L:(c + 1) * P * L], P)
        regroup_M = regroup_by_local_expert(recv_PL, sum(recv_splits))
        pending = _all_to_all_rows(rows_ND, recv_splits, send_splits, d.group)
        chunks.append(_Chunk(rows, send_splits, recv_splits, regroup_M, recv_PL.sum(0), pending))
    return chunks


# ----------------------------------------------------------------- capacity


def _dispatch_capacity(d: AllToAllDispatcher, x_TD, topk_idx_TK, topk_w_TK) -> _Chunk:
    """The capacity dispatch of `AllToAllDispatcher` for one chunk, its capacity from the chunk's T."""
    send_SD, handle = d.capacity_send(x_TD, topk_idx_TK, topk_w_TK)
    splits = d.capacity_splits(handle.capacity)
    pending = _all_to_all_rows(send_SD, splits, splits, d.group)
    tokens_L = d.capacity_tokens_per_local_expert(handle.capacity, x_TD.device)
    return _Chunk(handle.rows, splits, splits, None, tokens_L, pending, handle)


# ----------------------------------------------------------------- both modes


def _grouped(d: AllToAllDispatcher, ch: _Chunk) -> torch.Tensor:
    """The chunk's received rows grouped by local expert (waits for its dispatch)."""
    if ch.regroup_M is not None:
        return ch.pending[ch.regroup_M]
    return d.capacity_grouped(ch.pending, ch.capacity_handle.capacity)


def _combine_start(d: AllToAllDispatcher, ch: _Chunk, expert_y_MD: torch.Tensor) -> torch.Tensor:
    """Issue the chunk's return all-to-all (not waited)."""
    if ch.regroup_M is not None:
        y_ND = expert_y_MD[invert_permutation(ch.regroup_M)]
    else:
        y_ND = d.capacity_ungrouped(expert_y_MD, ch.capacity_handle.capacity)
    return _all_to_all_rows(y_ND, ch.send_splits, ch.recv_splits, d.group)


def _combine_finish(d: AllToAllDispatcher, ch: _Chunk) -> torch.Tensor:
    """Wait for the chunk's return rows; weight and sum them per token."""
    if ch.capacity_handle is not None:
        return d.capacity_unslot(ch.pending, ch.capacity_handle)  # a dropped row reads zero
    return from_expert_rows(ch.pending, ch.rows)


# ----------------------------------------------------------------- applying it

_CLASSES: dict[type, type] = {}


def overlapped_class(cls: type) -> type:
    """`cls` (MoEBlock or a subclass) with the overlapped forward; one class per base."""
    if issubclass(cls, OverlappedMoE):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Overlapped{cls.__name__}", (OverlappedMoE, cls), {})
    return _CLASSES[cls]


def problem(dispatcher) -> str | None:
    """Why a block with this dispatcher cannot run the overlapped forward, or None."""
    if not isinstance(dispatcher, AllToAllDispatcher):
        return f"parallel.ep_overlap needs the alltoall dispatcher, not {type(dispatcher).__name__}"
    if dispatcher.etp_size > 1:
        return f"parallel.ep_overlap is not built for expert tensor parallel (etp={dispatcher.etp_size})"
    if dispatcher.ep_size == 1:
        return "parallel.ep_overlap needs parallel.ep > 1 (nothing to overlap within one rank)"
    return None


def apply_ep_overlap(model: nn.Module) -> int:
    """Swap every MoE block of `model` (after expert parallel) to the overlapped forward; the count."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        reason = problem(block.dispatcher)
        if reason is not None:
            raise ValueError(reason)
        block.__class__ = overlapped_class(type(block))
    return len(blocks)
