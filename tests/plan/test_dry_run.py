"""The plan's dry run against real steps measured the same way (tracked storages, collectives issued).

A real step is the trainer's own `train_step`, fed the plan's full-budget micro-batches, measured in
its second step (the optimizer state then exists, as in every later step); the dry run builds the
same job on fake tensors.  Parameter, gradient and optimizer bytes must be equal, the peak of
activations within 15%, the collectives' bytes per group equal."""

from __future__ import annotations

import pytest
import torch

from moevlm.plan.dry_run import _roles, budget_micro_batch, dry_run
from moevlm.plan.fake import CollectiveCounter, StorageTracker
from moevlm.train.config import compose_job
from moevlm.train.metrics import Window
from moevlm.train.trainer import Trainer

COMMON = [
    "data.shards=sample",
    "data.num_workers=0",
    "train.steps=2",
    "train.log_every=1",
    "train.tensorboard=false",
    "train.checkpoint_at_end=false",
    "train.checkpoint_every=0",
    "train.require_loss_decrease=false",
    "train.progress=false",
]


def measured_step(job) -> dict:
    """The trainer's second step on the plan's budget micro-batches, measured."""
    trainer = Trainer(job)
    try:
        budget = budget_micro_batch(job, trainer.plan.model)
        trainer._fetch = lambda: [budget] * trainer.plan.grad_accum
        trainer.train_step(Window())
        params = list(trainer.model.parameters())
        state = [t for s in trainer.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        mem, comm = StorageTracker(), CollectiveCounter(_roles(trainer.parallel))
        mem.track(params + state)
        with mem, comm:
            trainer.train_step(Window())
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "params_bytes": nbytes(params),
            "optimizer_bytes": nbytes(state),
            "peak_bytes": mem.peak_bytes,
            "comm_bytes": comm.as_dict(),
        }
    finally:
        trainer.close()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_one_process_bytes_exact_and_peak_within_15_percent(tmp_path, recompute):
    job = compose_job(
        COMMON + [f"train.run_dir={tmp_path}", f"model.recompute={recompute}", "train.global_batch_size=2"]
    )
    plan = dry_run(job, bf16=False)
    real = measured_step(job)
    assert plan.params_bytes == real["params_bytes"] > 0
    assert plan.optimizer_bytes == real["optimizer_bytes"] >= 2 * plan.params_bytes  # + the step counts
    assert plan.grads_bytes == plan.params_bytes
    assert abs(plan.peak_bytes - real["peak_bytes"]) <= 0.15 * real["peak_bytes"], (
        plan.peak_bytes,
        real["peak_bytes"],
    )
    assert plan.comm_bytes == real["comm_bytes"] == {}
