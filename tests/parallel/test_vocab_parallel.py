"""Vocab-parallel cross-entropy on 2 gloo ranks equals F.cross_entropy on the full logits (loss and grad);
so does the LM head's loss over token chunks with the head's rows split over the ranks (loss, dh, dW)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import run_ranks

from moevlm.model.linear_ce import linear_cross_entropy
from moevlm.parallel.vocab_parallel import group_shard, vocab_parallel_cross_entropy

T, V = 7, 10  # vocab 10 over 2 ranks: 5 columns each


def _checks(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(T, V, generator=g) * 4).requires_grad_()
    target = torch.tensor([0, 4, 5, 9, -100, 7, 2])  # both shards, both edges, one ignored
    weights = torch.rand(T, generator=g)  # an arbitrary upstream gradient
    ref = F.cross_entropy(full, target, ignore_index=-100, reduction="none")
    (ref * weights).sum().backward()

    shard = V // world
    local = full.detach()[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, rank * shard)
    (loss * weights).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        local.grad, full.grad[:, rank * shard : (rank + 1) * shard], rtol=1e-6, atol=1e-7
    )
    assert loss[4] == 0 and local.grad[4].abs().sum() == 0
    _chunked_head(rank, world)


def _chunked_head(rank: int, world: int) -> None:
    """linear_cross_entropy over 4-token chunks (not dividing 11), this rank's rows of the head: the
    summed loss, dh summed over the ranks (the sequence gather's backward does it in the model) and
    this rank's rows of dW equal the whole head's, to 1e-6."""
    g = torch.Generator().manual_seed(1)
    n, D = 11, 6
    h, w = torch.randn(n, D, generator=g), torch.randn(V, D, generator=g)
    target = torch.tensor([0, 4, 5, 9, -100, 7, 2, 3, -100, 8, 1])
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(h_ref, w_ref), target, ignore_index=-100, reduction="sum")
    (ref * 0.37).backward()
    rows = slice(rank * (V // world), (rank + 1) * (V // world))
    h_loc, w_loc = h.clone().requires_grad_(), w[rows].clone().requires_grad_()
    total = linear_cross_entropy(h_loc, w_loc, target, 4, group_shard(None, rows.start))
    (total * 0.37).backward()
    dh = h_loc.grad.clone()
    dist.all_reduce(dh)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(dh, h_ref.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w_loc.grad, w_ref.grad[rows], rtol=1e-6, atol=1e-7)


def test_matches_full_cross_entropy_on_two_ranks(tmp_path):
    run_ranks(_checks, 2, tmp_path, 2)
