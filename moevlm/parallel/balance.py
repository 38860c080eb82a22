"""Load balancing across a step's micro-batches and data-parallel ranks: the expert frequencies of
the global-batch loss (`moe.aux_loss=global_batch`), and the step's load that moves the router bias.

Legend: E experts.  Rank r's m-th micro-batch is number g = m x dp + r of the step, and its
frequencies count the selections of micro-batches 0..g over every MoE layer.

    freqs = StepFrequencies(dp_group)      # once
    freqs.begin_step()                     # before each step's first micro-batch
    freq_E = freqs(counts_E, tokens)       # each micro-batch, in order, on every dp rank together
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moevlm.comm import all_gather_flat


class StepFrequencies:
    """Expert frequencies over the step's micro-batches 0..g (g this one's number, above)."""

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.seen = None  # [selections (E) | tokens] of the step's earlier rounds, all ranks

    def begin_step(self) -> None:
        self.seen = None

    def __call__(self, counts_E: torch.Tensor, tokens) -> torch.Tensor:
        """freq_E = (selections of micro-batches 0..g) / (their tokens); `counts_E` and `tokens` this
        micro-batch's, summed over its layers."""
        n = torch.as_tensor(tokens, dtype=torch.float32, device=counts_E.device).reshape(1)
        mine = torch.cat([counts_E.detach().float(), n])
        every = mine[None]
        if self.size > 1:
            every = all_gather_flat(mine[None], self.group)
        upto = every[: self.rank + 1].sum(0)
        total = upto if self.seen is None else self.seen + upto
        round_ = every.sum(0)
        self.seen = round_ if self.seen is None else self.seen + round_
        return total[:-1] / total[-1]


def step_load(counts_LE: torch.Tensor, group) -> torch.Tensor:
    """The step's selections per layer (the trainer's counts of this rank's micro-batches) summed
    over the data-parallel ranks: what moves the router bias (moe.router_bias_rate)."""
    load = counts_LE.detach().clone()
    if group is not None:
        dist.all_reduce(load, group=group)
    return load
