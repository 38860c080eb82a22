"""Which tokens of a packed row each context-parallel rank keeps, and which images it encodes (pure
index logic, no processes).

Legend: B batch, S sequence (the packed row), s = S / cp local sequence, cp the context-parallel
size.

    idx_Bs = split_rows(B, S, cu_seqlens, cp, r)   # (B, s) the positions rank r keeps of each row
    local = take_rows(x_BS, idx_Bs)                 # rank r's tokens of any (B, S, ...) tensor

Every document is cut into 2*cp chunks and rank r keeps chunks r and 2*cp-1-r
(`doc_zigzag_positions`); whole images go largest first to the least loaded rank.
"""

from __future__ import annotations

import torch


def check_divisible(S: int, cp: int) -> None:
    if S % (2 * cp):
        raise ValueError(
            f"a packed row of {S} tokens cannot be cut into 2*cp = {2 * cp} equal chunks: set "
            f"data.seq_len to a multiple of {2 * cp}"
        )


def zigzag_positions(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(S/cp,) the global positions rank `rank` keeps: chunk `rank` then chunk `2*cp-1-rank`."""
    check_divisible(S, cp)
    c = S // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def doc_zigzag_positions(bounds: list[int], cp: int) -> list[list[int]]:
    """The positions each rank keeps of one row whose documents end at `bounds` (row-relative, from 0 to
    S): every document cut into 2cp chunks, rank r keeps chunks r and 2cp-1-r of each.  Chunk sizes differ
    by at most one token; the extra tokens of a document go to the ranks holding fewest tokens so far, so
    every rank ends with exactly S/cp (falls back to `zigzag_positions` if it could not)."""
    S, n = bounds[-1], 2 * cp
    check_divisible(S, cp)
    load, out = [0] * cp, [[] for _ in range(cp)]
    for a, b in zip(bounds, bounds[1:]):
        L = b - a
        if L <= 0:
            continue
        sizes, took = [L // n] * n, [0] * cp
        for _ in range(L % n):  # each rank has two chunks of this document to grow
            r = min((r for r in range(cp) if took[r] < 2), key=lambda r: (load[r] + took[r], r))
            sizes[r if took[r] == 0 else n - 1 - r] += 1
            took[r] += 1
        start = a
        for j, size in enumerate(sizes):
            out[min(j, n - 1 - j)].extend(range(start, start + size))
            start += size
        for r in range(cp):
            load[r] += 2 * (L // n) + took[r]
    # the greedy keeps the spread within one token
    if any(x != S // cp for x in load):  # pragma: no cover
        return [zigzag_positions(S, cp, r).tolist() for r in range(cp)]
    return [sorted(o) for o in out]


def split_rows(
    B: int, S: int, cu_seqlens: torch.Tensor | None, cp: int, rank: int, device=None
) -> torch.Tensor:
    """(B, S/cp) the positions rank `rank` keeps of each row (`doc_zigzag_positions` of the row's
    documents; `cu_seqlens` over the flattened B*S tokens, None = one document per row).  Host loop over
    the documents (one device-to-host copy of `cu_seqlens`)."""
    return every_rank_rows(B, S, cu_seqlens, cp, device)[rank]


def every_rank_rows(
    B: int, S: int, cu_seqlens: torch.Tensor | None, cp: int, device=None
) -> torch.Tensor:
    """(cp, B, S/cp) `split_rows` of every rank (one host loop over the documents)."""
    cu = [] if cu_seqlens is None else cu_seqlens.tolist()
    rows = []
    for b in range(B):
        inner = sorted({c - b * S for c in cu if b * S < c < (b + 1) * S} | {0, S})
        rows.append(doc_zigzag_positions(inner, cp))
    every = torch.tensor(rows, dtype=torch.long)  # on the host; no stream sync for the copy
    return (every if device is None else every.to(device, non_blocking=True)).transpose(0, 1)


def take_rows(x: torch.Tensor, idx_Bs: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """x at positions idx_Bs[b] of each row b, along `dim` (the batch dim is dim-1); differentiable (the
    gradient is zero at the positions not taken)."""
    shape = [1] * x.ndim
    shape[dim - 1], shape[dim] = idx_Bs.shape
    index = (
        idx_Bs.to(x.device).view(shape).expand(*x.shape[:dim], idx_Bs.shape[1], *x.shape[dim + 1 :])
    )
    return x.gather(dim, index)


def contiguous_positions(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(S/cp,) the naive split (rank r keeps the r-th S/cp tokens), for comparison only."""
    s = S // cp
    return torch.arange(rank * s, (rank + 1) * s, device=device)


def take_seq(x: torch.Tensor, idx: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The positions `idx` of `x` along `dim` (a copy)."""
    return x.index_select(dim, idx.to(x.device))


def inverse_order(S: int, cp: int, device=None) -> torch.Tensor:
    """(S,) where each global position sits in the concatenation of all ranks' local tokens."""
    order = torch.cat([zigzag_positions(S, cp, r, device) for r in range(cp)])
    return torch.empty_like(order).scatter_(0, order, torch.arange(S, device=device))


def attention_work(
    doc_BS: torch.Tensor, positions: list[torch.Tensor], causal: bool = True
) -> list[int]:
    """Allowed (query, key) pairs each rank computes: its queries against the whole row, same document,
    and key <= query when causal.  `doc_BS` holds each token's document id, `positions[r]` rank r's."""
    B, S = doc_BS.shape
    pos = torch.arange(S)
    work = []
    for idx in positions:
        same = doc_BS[:, idx, None] == doc_BS[:, None, :]  # (B, s, S)
        if causal:
            same &= pos[None, None, :] <= idx[None, :, None]
        work.append(int(same.sum()))
    return work


__all__ = [
    "attention_work",
    "check_divisible",
    "contiguous_positions",
    "doc_zigzag_positions",
    "every_rank_rows",
    "inverse_order",
    "split_rows",
    "take_rows",
    "take_seq",
    "zigzag_positions",
]
