"""Vocab-parallel cross-entropy on 2 gloo ranks equals F.cross_entropy on the full logits (loss and grad)."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moevlm.parallel.vocab_parallel import vocab_parallel_cross_entropy

T, V = 7, 10  # vocab 10 over 2 ranks: 5 columns each


def _worker(rank: int, world: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        full = (torch.randn(T, V, generator=g) * 4).requires_grad_()
        target = torch.tensor([0, 4, 5, 9, -100, 7, 2])  # both shards, both edges, one ignored
        weights = torch.rand(T, generator=g)  # an arbitrary upstream gradient
        ref = F.cross_entropy(full, target, ignore_index=-100, reduction="none")
        (ref * weights).sum().backward()

        shard = V // world
        local = full.detach()[:, rank * shard:(rank + 1) * shard].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, rank * shard)
        (loss * weights).sum().backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local.grad, full.grad[:, rank * shard:(rank + 1) * shard], rtol=1e-6, atol=1e-7)
        assert loss[4] == 0 and local.grad[4].abs().sum() == 0
    except AssertionError as err:
        errors.put(f"rank {rank}: {err}")
    finally:
        dist.destroy_process_group()


def test_matches_full_cross_entropy_on_two_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, port, errors), nprocs=2)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
