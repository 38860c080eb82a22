"""Context parallel (CP) for packed multimodal rows: every row split over the cp ranks,
load-balanced.

Legend: B rows, S sequence (the packed row), s = S/cp this rank's tokens (s/tp between blocks under
sequence parallel), D hidden, O text width, N patches, I images, m = merge^2 patches per image
token.

`cp_strategies` gives the strategies a model is built with, composed over tensor parallel's (no
weight changes): the vision tower encodes a share of whole images and video frames
(moevlm.model.image_shares.balance_images, frame_grids) and
all-gathers the features; the embedding keeps this rank's tokens of the full row
(cp_layout.split_rows); attention runs local queries against every rank's keys (cp_attention); each
rank routes and scores its own tokens; a Gated DeltaNet gathers the whole row and runs 1/cp of its heads
(of tp's share under cp x tp; `CPSequence.gather_whole` / `scatter_sum`).  Why: docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moevlm.comm import all_gather_flat, all_reduce_sum
from moevlm.model.attention import CoreAttention, DocMask, document_ids
from moevlm.model.image_shares import balance_images, frame_grids
from moevlm.model.region import run_region
from moevlm.model.strategies import Images, Sequence
from moevlm.parallel.comm import gather_seq, reduce_scatter_seq
from moevlm.parallel.cp_attention import COMMS as CP_COMMS
from moevlm.parallel.cp_attention import cp_attention
from moevlm.parallel.cp_layout import every_rank_rows, take_rows


class CPInfo:
    """The cp group of one rank: its size, rank and the attention's communication pattern."""

    def __init__(self, group, comm: str):
        if comm not in CP_COMMS:
            raise ValueError(f"parallel.cp_comm={comm!r}; choose one of {CP_COMMS}")
        self.group, self.comm = group, comm
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.idx_Bs: torch.Tensor | None = None  # (B, s) this rank's positions of the micro-batch
        self.order_BS: torch.Tensor | None = None  # (B, S) every rank's positions, in rank order
        self.inverse_BS: torch.Tensor | None = None  # (B, S) where each position sits in order_BS

    def set_rows(self, cu_seqlens: torch.Tensor | None, B: int, S: int, device) -> None:
        """Each rank's positions of each row of the micro-batch about to run (cp_layout.split_rows);
        called where a micro-batch enters the model (forward, a pipeline stage)."""
        every = every_rank_rows(B, S, cu_seqlens, self.size, device)
        self.idx_Bs, self.order_BS = every[self.rank], torch.cat(list(every), dim=1)
        self.inverse_BS = torch.argsort(self.order_BS, dim=1)

    def take(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        if self.idx_Bs is None or self.idx_Bs.shape[0] != t.shape[dim - 1]:
            raise RuntimeError(
                "context parallel: no micro-batch layout set (CPInfo.set_rows) for this input"
            )
        return take_rows(t, self.idx_Bs, dim)


class CPImages(Images):
    """Images and video frames encoded in shares (balanced by patches) and gathered back in order."""

    def __init__(self, cp: CPInfo):
        self.cp = cp

    def encode(self, encode_fn, pixel_values_NP, grid_thw_I3, merge: int):
        merge2 = merge**2
        frames = frame_grids(grid_thw_I3.tolist())  # one host read
        grid_thw_I3 = grid_thw_I3.new_tensor(frames).reshape(-1, 3)
        sizes = [t * h * w for t, h, w in frames]
        n = sum(sizes) // merge2
        per_rank = balance_images(sizes, self.cp.size)
        mine = per_rank[self.cp.rank]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        if mine:
            pixels = torch.cat([pixel_values_NP[starts[i] : starts[i + 1]] for i in mine])
        else:  # no image here: the tower still runs (one isolated padding segment), so every rank's
            # backward is the same
            pixels = pixel_values_NP.new_zeros(merge2, pixel_values_NP.shape[1])
        out_NO, deepstack, n_mine = encode_fn(pixels, grid_thw_I3[mine])
        parts = [out_NO, *deepstack]
        link = sum(t[n_mine:].sum() for t in parts) * 0.0  # this rank's padding rows, in the graph
        rows_mine = torch.cat([t[:n_mine] for t in parts], dim=-1)
        # every rank knows every share (same grids, same rule): the row counts need no exchange
        counts = [sum(sizes[i] for i in share) // merge2 for share in per_rank]
        rows = rows_mine
        if n:  # all ranks' rows, from rank order (each rank's images ascending) to image order
            rows = _GatherRows.apply(rows_mine, self.cp.group, counts)
            tok = [s // merge2 for s in starts]
            order = torch.cat(
                [torch.arange(tok[i], tok[i + 1]) for share in per_rank for i in share]
            )
            rows = torch.empty_like(rows).index_copy(0, order.to(rows.device), rows)
        pad = pixel_values_NP.shape[0] // merge2 - n  # the shape a one-process forward returns
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) + link.to(rows.dtype)
        widths = [t.shape[1] for t in parts]
        out_NO, *deepstack = rows.split(widths, dim=-1)
        return out_NO, deepstack, n


class _GatherRows(torch.autograd.Function):
    """All ranks' rows (a different count per rank) concatenated in rank order; backward: the gradient
    summed over the group, each rank keeping its own rows."""

    @staticmethod
    def forward(ctx, rows, group, counts):
        most = max(counts)
        padded = torch.cat([rows, rows.new_zeros(most - rows.shape[0], *rows.shape[1:])])
        every = all_gather_flat(padded, group).view(len(counts), most, *rows.shape[1:])
        ctx.group, ctx.counts, ctx.rank = group, counts, dist.get_rank(group)
        return torch.cat([every[r, :c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad):
        total = all_reduce_sum(grad.contiguous(), ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return total[start : start + ctx.counts[ctx.rank]], None, None


# ---------------------------------------------------------------- the decoder
class CPSequence(Sequence):
    """Layers see this rank's zigzag tokens, then `inner`'s share of them (tensor parallel's, or all);
    attention sees the cp-local sequence with its global positions and document ids."""

    sharded = True

    def __init__(self, cp: CPInfo, inner: Sequence):
        self.cp, self.inner = cp, inner

    def begin(self, cu_seqlens, B, S, device):
        self.cp.set_rows(cu_seqlens, B, S, device)

    def enter(self, t_BS):
        return None if t_BS is None else self.inner.enter(self.cp.take(t_BS))

    def positions(self, position_ids_3BS):
        return self.cp.take(position_ids_3BS, dim=2)

    def mask(self, B, S, cu_seqlens, *, device, **_):
        doc = self.cp.take(document_ids(B, S, cu_seqlens, device))
        return DocMask("cp", True, [], (self.cp.idx_Bs, doc), cu_seqlens)

    def gather(self, x):
        return self.inner.gather(x)

    def scatter_linear(self, linear, x):
        return self.inner.scatter_linear(linear, x)

    def gather_whole(self, x_BsD):
        """Every cp rank's tokens, in row order (the Gated DeltaNet's recurrence; `inner` whole)."""
        every_BSD = gather_seq(self.inner.gather_whole(x_BsD), self.cp.group)  # in rank order
        return take_rows(every_BSD, self.cp.inverse_BS)

    def scatter_sum(self, y_BSD):
        """The row's partial sums (one per cp rank's heads) summed, each rank keeping its tokens."""
        mine = reduce_scatter_seq(take_rows(y_BSD, self.cp.order_BS).contiguous(), self.cp.group)
        return self.inner.scatter_sum(mine)


class CPCoreAttention(CoreAttention):
    """Queries local, keys/values from every cp rank (`cp_attention`, allgather or ring)."""

    def __init__(self, cp: CPInfo):
        super().__init__()
        self.cp = cp

    def extra_repr(self) -> str:
        return f"cp={self.cp.size}, comm={self.cp.comm}"

    def forward(self, q_BsHD, k_BsKD, v_BsKD, mask: DocMask) -> torch.Tensor:
        return run_region(self, "region", self._attend, q_BsHD, k_BsKD, v_BsKD, mask)

    def _attend(self, q_BsHD, k_BsKD, v_BsKD, mask: DocMask) -> torch.Tensor:
        pos, doc = mask.prepared
        return cp_attention(
            q_BsHD,
            k_BsKD,
            v_BsKD,
            pos,
            doc,
            group=self.cp.group,
            comm=self.cp.comm,
            causal=mask.causal,
        )


def cp_strategies(cp_group, comm: str, inner: Sequence) -> tuple[CPInfo, dict]:
    """(the cp group's info, the Strategies fields of context parallel over `cp_group`, composed over the
    sequence strategy `inner`: tensor parallel's, or the whole-sequence one)."""
    info = CPInfo(cp_group, comm)
    # Gated DeltaNet heads: 1/cp of this rank's tensor-parallel share (of all of them without tp)
    tp_group = getattr(inner, "group", None)
    tp_rank, tp = (
        (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    )
    return info, dict(
        sequence=CPSequence(info, inner),
        images=CPImages(info),
        attention=lambda: CPCoreAttention(info),
        head_share=(tp_rank * info.size + info.rank, tp * info.size),
    )


__all__ = ["CP_COMMS", "CPCoreAttention", "CPImages", "CPInfo", "CPSequence", "cp_strategies"]
