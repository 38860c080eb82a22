"""The out-of-place collectives that the layouts (moevlm.parallel) and the dispatchers
(moevlm.dispatch) share: torch's functional ops (`torch.ops._c10d_functional`), each followed
by its `wait_tensor`, without autograd.

Why functional rather than `dist.all_gather_into_tensor` and its in-place family: selective
activation checkpointing (moevlm/parallel/recompute.py) can keep their outputs and hand them
back when a region is recomputed, so a backward never issues a collective twice. The ops exist
with these schemas on torch 2.11 and 2.13, on NCCL and gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_F = torch.ops._c10d_functional


def all_gather_flat(x: torch.Tensor, group) -> torch.Tensor:
    """The group's tensors concatenated along dim 0."""
    return _F.wait_tensor(
        _F.all_gather_into_tensor(x.contiguous(), dist.get_world_size(group), group.group_name)
    )


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """A new tensor: the sum over the group."""
    return _F.wait_tensor(_F.all_reduce(x.contiguous(), "sum", group.group_name))


def reduce_scatter_sum(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/n of the group's sum along dim 0 (rows must divide evenly over the group)."""
    n = dist.get_world_size(group)
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter of {x.shape[0]} rows over {n} ranks: must divide evenly")
    return _F.wait_tensor(_F.reduce_scatter_tensor(x.contiguous(), "sum", n, group.group_name))


def all_to_all_flat(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
) -> torch.Tensor:
    """Uneven all-to-all of rows along dim 0: `in_splits` rows to each rank, `out_splits` from each."""
    return _F.wait_tensor(
        _F.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name)
    )


__all__ = ["all_gather_flat", "all_reduce_sum", "all_to_all_flat", "reduce_scatter_sum"]
