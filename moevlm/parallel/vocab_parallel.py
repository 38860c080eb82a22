"""Vocab-parallel cross-entropy: the LM head's logits stay sharded over the tensor-parallel group
along the vocabulary; the full (T, V) logits are never gathered.

Legend: T tokens, V local vocabulary shard.

    loss_T = vocab_parallel_cross_entropy(logits_TV, target_T, vocab_start, group)

Three all-reduces of (T,) vectors: the max (for stability), the sum of exponentials, and the
target's logit (each target lives on exactly one rank).  Backward is local: softmax minus one-hot
on the shard that holds the target, scaled by the incoming gradient.  `ignore_index` targets give
0 loss and 0 gradient.  Computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, target_T, vocab_start: int, group, ignore_index: int):
        logits_TV = logits_TV.float()
        max_T = logits_TV.max(dim=-1).values
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
        shifted_TV = logits_TV - max_T[:, None]
        exp_TV = shifted_TV.exp()
        sum_T = exp_TV.sum(dim=-1)
        dist.all_reduce(sum_T, group=group)
        local_T = target_T - vocab_start
        here_T = (local_T >= 0) & (local_T < logits_TV.shape[-1]) & (target_T != ignore_index)
        safe_T = torch.where(here_T, local_T, torch.zeros_like(local_T))
        target_logit_T = shifted_TV.gather(1, safe_T[:, None]).squeeze(1) * here_T
        dist.all_reduce(target_logit_T, group=group)
        valid_T = target_T != ignore_index
        loss_T = (sum_T.log() - target_logit_T) * valid_T
        ctx.save_for_backward(exp_TV, sum_T, safe_T, here_T, valid_T)
        return loss_T

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
