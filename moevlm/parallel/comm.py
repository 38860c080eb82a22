"""Collectives with the backward that tensor/sequence parallelism needs (identity for one rank).

Each is the adjoint of another, so a forward/backward pair always moves the same bytes:

    gather_seq          fwd all-gather along `dim`        bwd reduce-scatter (sum) along `dim`
    reduce_scatter_seq  fwd reduce-scatter along `dim`     bwd all-gather along `dim`
    split_seq           fwd keep this rank's chunk         bwd all-gather along `dim`
    sum_replicated      fwd all-reduce (sum)               bwd identity

`sum_replicated` is for values every rank of the group then uses identically (the loss, replicated
over tp): each rank already holds the whole upstream gradient.  Shapes must divide evenly along
`dim`.  Built on the functional collectives of moevlm.comm (NCCL and gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moevlm.comm import all_gather_flat, all_reduce_sum, reduce_scatter_sum


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return all_gather_flat(x.movedim(dim, 0), group).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return reduce_scatter_sum(x.movedim(dim, 0), group).movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"splitting {x.shape[dim]} positions over {n} ranks: must divide evenly")
    return x.chunk(n, dim=dim)[r].contiguous()


def _adjoint_pair(name: str, fwd, bwd) -> type[torch.autograd.Function]:
    """An autograd function running `fwd(x, dim, group)` forward and `bwd` backward."""

    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return fwd(x, dim, group)

    def backward(ctx, g):
        return bwd(g, ctx.dim, ctx.group), None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


_GatherSeq = _adjoint_pair("_GatherSeq", _all_gather, _reduce_scatter)
_ReduceScatterSeq = _adjoint_pair("_ReduceScatterSeq", _reduce_scatter, _all_gather)
_SplitSeq = _adjoint_pair("_SplitSeq", _split, _all_gather)


class _SumReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatterSeq.apply(x, dim, group)


def split_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return x if _size(group) == 1 else _SplitSeq.apply(x, dim, group)


def sum_replicated(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _SumReplicated.apply(x, group)
