"""Linear cross-entropy over token chunks: the LM head's summed loss and its gradients without ever
holding the whole micro-batch's logits.

Legend: T tokens, D hidden, V vocabulary rows this rank holds, C tokens of a chunk.

    total = linear_cross_entropy(h_TD, w_VD, target_T, chunk=1024)          # sum over counted tokens
    total = linear_cross_entropy(h_TD, w_VD, target_T, 1024, shard)         # rows split over ranks

A chunk's logits come from the GEMM in the inputs' dtype (autocast's where on), promoted to fp32 as
the whole-logits path does; forward keeps each token's max and sum of exponentials, backward
recomputes each chunk's logits for dh and dW (dW summed in fp32).  `VocabShard`: this rank's rows and
how per-token statistics combine over the other ranks (moevlm.parallel.vocab_parallel.group_shard).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moevlm.model.autocast import compute_dtype

IGNORE_INDEX = -100


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, start + V) of the vocabulary; `all_max` / `all_sum` combine a (C,) vector of
    per-token statistics over the ranks holding the other rows (identity: this rank holds them all)."""

    start: int = 0
    all_max: Callable[[torch.Tensor], torch.Tensor] = _whole
    all_sum: Callable[[torch.Tensor], torch.Tensor] = _whole


@dataclass
class Stats:
    """Per token over the whole vocabulary: max logit, sum of exp(logit - max), the target's
    logit - max (0 where ignored); where the target is among this rank's rows (`here`, local index
    `safe`, 0 elsewhere) and whether it counts (`valid`)."""

    max_C: torch.Tensor
    sum_C: torch.Tensor
    target_C: torch.Tensor
    safe_C: torch.Tensor
    here_C: torch.Tensor
    valid_C: torch.Tensor

    def loss(self) -> torch.Tensor:
        """(C,) cross-entropy, 0 where ignored."""
        return (self.sum_C.log() - self.target_C) * self.valid_C


def target_index(target_C, shard: VocabShard, rows: int, ignore_index: int):
    """(local index or 0, here, valid) of each target among this rank's `rows` rows."""
    local_C = target_C - shard.start
    valid_C = target_C != ignore_index
    here_C = (local_C >= 0) & (local_C < rows) & valid_C
    return torch.where(here_C, local_C, torch.zeros_like(local_C)), here_C, valid_C


def exp_stats(x_CV: torch.Tensor, target_C, shard: VocabShard, ignore_index: int) -> Stats:
    """The statistics of fp32 logits `x` (this rank's rows), which become exp(x - max) in place."""
    max_C = shard.all_max(x_CV.max(dim=-1).values)
    x_CV.sub_(max_C[:, None])
    safe_C, here_C, valid_C = target_index(target_C, shard, x_CV.shape[-1], ignore_index)
    target = shard.all_sum(x_CV.gather(1, safe_C[:, None]).squeeze(1) * here_C)
    sum_C = shard.all_sum(x_CV.exp_().sum(dim=-1))
    return Stats(max_C, sum_C, target, safe_C, here_C, valid_C)


def _chunks(T: int, chunk: int):
    step = chunk if chunk > 0 else max(T, 1)
    return [(s, min(s + step, T)) for s in range(0, T, step)]


def _logits(h_CD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """A chunk's logits in fp32, a fresh tensor (free to overwrite)."""
    x = F.linear(h_CD, w_VD)
    return x if x.dtype == torch.float32 else x.float()


def _no_autocast(device_type: str):
    """Autocast off where it is on: the GEMMs run in the dtype chosen at the call."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, target_T, chunk: int, shard: VocabShard, ignore_index: int, dtype):
        ctx.dtypes = h_TD.dtype, w_VD.dtype
        h_TD, w_VD = h_TD.to(dtype), w_VD.to(dtype)  # autocast's casts, once
        T = h_TD.shape[0]
        max_T = h_TD.new_empty(T, dtype=torch.float32)
        sum_T = torch.empty_like(max_T)
        total = h_TD.new_zeros((), dtype=torch.float32)
        for s, e in _chunks(T, chunk):
            st = exp_stats(_logits(h_TD[s:e], w_VD), target_T[s:e], shard, ignore_index)
            total += st.loss().sum()
            max_T[s:e], sum_T[s:e] = st.max_C, st.sum_C
        ctx.save_for_backward(h_TD, w_VD, target_T, max_T, sum_T)
        ctx.chunk, ctx.shard, ctx.ignore_index = chunk, shard, ignore_index
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h_TD, w_VD, target_T, max_T, sum_T = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dh_TD = torch.empty_like(h_TD) if need_h else None
        dw_VD = torch.zeros_like(w_VD, dtype=torch.float32) if need_w else None
        with _no_autocast(h_TD.device.type):
            for s, e in _chunks(h_TD.shape[0], ctx.chunk):
                g_CV = _softmax_grad(
                    h_TD[s:e], w_VD, target_T[s:e], max_T[s:e], sum_T[s:e], ctx, grad
                )
                if need_h:
                    torch.mm(g_CV, w_VD, out=dh_TD[s:e])
                if need_w and g_CV.dtype == torch.float32:
                    dw_VD.addmm_(g_CV.t(), h_TD[s:e])
                elif need_w:
                    dw_VD += torch.mm(g_CV.t(), h_TD[s:e])
        h_dtype, w_dtype = ctx.dtypes
        dh_TD = None if dh_TD is None else dh_TD.to(h_dtype)
        dw_VD = None if dw_VD is None else dw_VD.to(w_dtype)
        return dh_TD, dw_VD, None, None, None, None, None


def _softmax_grad(h_CD, w_VD, target_C, max_C, sum_C, ctx, grad) -> torch.Tensor:
    """d(total)/d(logits) of a chunk, (softmax - one-hot) x grad at counted tokens, in the GEMMs' dtype."""
    p_CV = _logits(h_CD, w_VD).sub_(max_C[:, None]).exp_().div_(sum_C[:, None])
    safe_C, here_C, valid_C = target_index(target_C, ctx.shard, p_CV.shape[-1], ctx.ignore_index)
    p_CV.scatter_add_(1, safe_C[:, None], -here_C.to(p_CV.dtype)[:, None])
    p_CV.mul_((grad * valid_C)[:, None])
    return p_CV.to(h_CD.dtype)


def linear_cross_entropy(
    h_TD: torch.Tensor,
    w_VD: torch.Tensor,
    target_T: torch.Tensor,
    chunk: int,
    shard: VocabShard | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over the counted tokens (target != ignore_index) of the cross-entropy of h @ w.T (fp32,
    0-dim), `chunk` tokens at a time (<= 0: all at once); `shard` when w holds part of the rows.  The
    GEMMs run in autocast's dtype where it is on (as F.linear would), else in the inputs'."""
    device = h_TD.device.type
    dtype = compute_dtype(device, h_TD.dtype)
    with _no_autocast(device):
        return _LinearCrossEntropy.apply(
            h_TD, w_VD, target_T, int(chunk), shard or VocabShard(), ignore_index, dtype
        )


__all__ = [
    "IGNORE_INDEX",
    "Stats",
    "VocabShard",
    "exp_stats",
    "linear_cross_entropy",
    "target_index",
]
