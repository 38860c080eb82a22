"""Vocab-parallel cross-entropy: the LM head's logits stay sharded over the tensor-parallel group
along the vocabulary; the full (T, V) logits are never gathered.

Legend: T tokens, V local vocabulary shard.

    loss_T = vocab_parallel_cross_entropy(logits_TV, target_T, vocab_start, group)
    shard = group_shard(group, vocab_start)    # the same reductions for moevlm.model.linear_ce

Three all-reduces of (T,) vectors: the max (for stability), the target's logit (each target lives
on exactly one rank) and the sum of exponentials.  Backward is local: softmax minus one-hot on the
shard that holds the target, scaled by the incoming gradient.  `ignore_index` targets give 0 loss
and 0 gradient.  Computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moevlm.model.linear_ce import VocabShard, exp_stats


def group_shard(group, vocab_start: int) -> VocabShard:
    """Rows from `vocab_start` on this rank; per-token statistics all-reduced over `group`."""

    def all_max(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def all_sum(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return VocabShard(vocab_start, all_max, all_sum)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, vocab_start: int, group, ignore_index: int):
        exp_TV = logits_TV.to(torch.float32, copy=True)
        st = exp_stats(exp_TV, target_T, group_shard(group, vocab_start), ignore_index)
        ctx.save_for_backward(exp_TV, st.sum_C, st.safe_C, st.here_C, st.valid_C)
        return st.loss()

    @staticmethod
    def backward(ctx, grad_T):
        exp_TV, sum_T, safe_T, here_T, valid_T = ctx.saved_tensors
        grad_TV = exp_TV / sum_T[:, None]
        grad_TV.scatter_add_(1, safe_T[:, None], -here_T.to(grad_TV.dtype)[:, None])
        grad_TV *= (grad_T * valid_T)[:, None]
        return grad_TV, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_TV: torch.Tensor,
    target_T: torch.Tensor,
    vocab_start: int,
    group=None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32) of logits sharded along the vocabulary: this
    rank holds columns [vocab_start, vocab_start + V).  No reduction over tokens."""
    return _VocabParallelCE.apply(logits_TV, target_T, vocab_start, group, ignore_index)


__all__ = ["group_shard", "vocab_parallel_cross_entropy"]
