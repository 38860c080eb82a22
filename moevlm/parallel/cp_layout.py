"""Which tokens of a packed row each context-parallel rank keeps (pure index logic, no processes).

Legend: B batch, S sequence (the packed row), s = S / cp local sequence, cp the context-parallel size.

    idx = zigzag_positions(S, cp, r)        # (s,) global positions rank r keeps, in its local order
    local = take_seq(x_BS..., idx)            # rank r's tokens of any (B, S, ...) tensor
    shares = balance_images(grid_thw, cp)     # which images each rank's vision tower encodes

Design choices:
- The row is cut into 2*cp equal chunks; rank r keeps chunk r and chunk 2*cp-1-r, in that order (the
  "zigzag" of causal load balancing): under a causal mask the work of a query grows with its position, so
  pairing an early chunk with its mirror from the end gives every rank about the same number of allowed
  (query, key) pairs.  The cut is per row, not per document: a packed row has a fixed S (divisible by
  2*cp), while its documents have any length (a per-document cut would pad every document to a multiple
  of 2*cp, changing the data).  `attention_work` measures the balance both ways (docs/benchmarks.md).
- Images are encoded where they are balanced, not where their tokens land: `balance_images` hands whole
  images to ranks, largest first to the least loaded (LPT), so the vision tower's patches are spread
  evenly; the features are gathered afterwards.
"""

from __future__ import annotations

import torch


def check_divisible(S: int, cp: int) -> None:
    if S % (2 * cp):
        raise ValueError(f"a packed row of {S} tokens cannot be cut into 2*cp = {2 * cp} equal chunks: set "
                         f"data.seq_len to a multiple of {2 * cp}")


def zigzag_positions(S: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(S/cp,) the global positions rank `rank` keeps: chunk `rank` then chunk `2*cp-1-rank`."""
    check_divisible(S, cp)
    c = S // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


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


def attention_work(doc_BS: torch.Tensor, positions: list[torch.Tensor], causal: bool = True) -> list[int]:
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


def balance_images(patches_per_image: list[int], cp: int) -> list[list[int]]:
    """Image indices per rank (each list ascending), whole images, patches balanced largest-first."""
    load, shares = [0] * cp, [[] for _ in range(cp)]
    for i in sorted(range(len(patches_per_image)), key=lambda i: (-patches_per_image[i], i)):
        r = min(range(cp), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += patches_per_image[i]
    return [sorted(s) for s in shares]


__all__ = ["attention_work", "balance_images", "check_divisible", "contiguous_positions", "inverse_order",
           "take_seq", "zigzag_positions"]
