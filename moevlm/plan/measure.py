"""A real training step measured the way a plan counts: tracked storages and collectives issued.

    got = measure_trainer_step(job)     # the Trainer's second step on the plan's budget micro-batches

The step is the trainer's own `train_step`, fed a plan's full-budget micro-batches and routed as a
plan routes (`BalancedRouting`); on a GPU it also reports `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import torch

from moevlm.plan.dry_run import _bytes, _roles, budget_micro_batch
from moevlm.plan.fake import BalancedRouting, CollectiveCounter, StorageTracker


def measure_trainer_step(job) -> dict:
    """params_bytes, optimizer_bytes, peak_bytes (tracked storages), comm_bytes of the Trainer's second
    step, and on CUDA cuda_max_allocated_bytes and cuda_max_reserved_bytes (the caching allocator's
    peak, fragmentation included); the trainer is closed after."""
    from moevlm.train.metrics import Window
    from moevlm.train.trainer import Trainer

    trainer = Trainer(job)
    try:
        budget = budget_micro_batch(job, trainer.plan.model)
        micro = [budget] * trainer.plan.grad_accum
        with BalancedRouting():  # the plan's routing (a real router's choices move other volumes)
            trainer.train_step(Window(), micro)
        params = list(trainer.model.parameters())
        state = [t for s in trainer.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        mem, comm = StorageTracker(), CollectiveCounter(_roles(trainer.parallel))
        mem.track(params + state)
        cuda = trainer.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        with BalancedRouting(), mem, comm:
            trainer.train_step(Window(), micro)
        got = {
            "params_bytes": _bytes(params),  # local shards
            "optimizer_bytes": _bytes(state),
            "peak_bytes": mem.peak_bytes,
            "comm_bytes": comm.as_dict(),
            # the activation offload's host copies (moevlm.parallel.offload): made, most held at once
            "activation_offload_bytes": mem.host_total_bytes,
            "activation_host_bytes": mem.host_peak_bytes,
        }
        if cuda:
            got["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
            got["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(trainer.device)
        return got
    finally:
        trainer.close()
