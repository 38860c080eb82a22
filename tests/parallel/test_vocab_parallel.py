"""Vocab-parallel cross-entropy on 2 gloo ranks equals F.cross_entropy on the full logits (loss and grad)."""

import torch
import torch.nn.functional as F
from gloo_ranks import run_ranks

from moevlm.parallel.vocab_parallel import vocab_parallel_cross_entropy

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


def test_matches_full_cross_entropy_on_two_ranks(tmp_path):
    run_ranks(_checks, 2, tmp_path, 2)
