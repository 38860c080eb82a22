"""The plan's dry run against real steps measured the same way (tracked storages, collectives issued).

A real step is the trainer's own `train_step` on the plan's full-budget micro-batches, routed as the
plan routes, measured in its second step (`moevlm.plan.measure`); the dry run builds the same job on
fake tensors.  Parameter, gradient and optimizer bytes must be equal, the peak of
activations within 15%, the collectives' bytes per group equal."""

from __future__ import annotations

import pytest
import torch

from moevlm.config import compose_job
from moevlm.plan.dry_run import dry_run
from moevlm.plan.measure import measure_trainer_step

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


@pytest.mark.parametrize("recompute", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_one_process_bytes_exact_and_peak_within_15_percent(tmp_path, recompute):
    job = compose_job(
        COMMON
        + [f"train.run_dir={tmp_path}", f"model.recompute={recompute}", "train.global_batch_size=2"]
    )
    plan = dry_run(job, bf16=False)
    real = measure_trainer_step(job)
    assert plan.params_bytes == real["params_bytes"] > 0
    # + the step counts
    assert plan.optimizer_bytes == real["optimizer_bytes"] >= 2 * plan.params_bytes
    assert plan.grads_bytes == plan.params_bytes
    assert abs(plan.peak_bytes - real["peak_bytes"]) <= 0.15 * real["peak_bytes"], (
        plan.peak_bytes,
        real["peak_bytes"],
    )
    assert plan.comm_bytes == real["comm_bytes"] == {}


# LoRA with the base frozen in bf16 (optim.master_weights: fp32 masters of the adapters
# alone): attention, dense-MLP and expert adapters; the base gets no gradient and no optimizer state
LORA = [
    "model.lora_rank=8",
    "model.lora_modules=[attn,mlp,experts]",
    "optim.master_weights=true",
    "train.precision=bf16",
]


def test_lora_bytes_exact_and_peak_within_15_percent(tmp_path, monkeypatch):
    from moevlm.train.trainer import Trainer

    seen = {}
    clip = Trainer._clip

    def counted_clip(self):
        # the real step's gradients (set to None after the step) and trainable weights, at the clip
        params = list(self.model.parameters())
        seen["grads"] = sum(p.grad.numel() * p.grad.itemsize for p in params if p.grad is not None)
        seen["trainable"] = sum(p.numel() * p.itemsize for p in params if p.requires_grad)
        seen["frozen_dtypes"] = {p.dtype for p in params if not p.requires_grad}
        return clip(self)

    monkeypatch.setattr(Trainer, "_clip", counted_clip)
    job = compose_job(COMMON + [f"train.run_dir={tmp_path}", "train.global_batch_size=2"] + LORA)
    plan = dry_run(job, bf16=True)
    real = measure_trainer_step(job)
    assert seen["frozen_dtypes"] == {torch.bfloat16}
    assert plan.params_bytes == real["params_bytes"] > 0
    assert plan.grads_bytes == seen["grads"] == seen["trainable"] < plan.params_bytes / 5
    # the adapters' fp32 masters and two fp32 moments (+ the step counts); nothing of the base
    assert plan.optimizer_bytes == real["optimizer_bytes"]
    assert 6 * seen["trainable"] <= plan.optimizer_bytes < 6 * seen["trainable"] + 4096
    assert abs(plan.peak_bytes - real["peak_bytes"]) <= 0.15 * real["peak_bytes"], (
        plan.peak_bytes,
        real["peak_bytes"],
    )


# Layouts of 4 ranks checked in one gloo launch: FSDP with tensor and expert parallelism, pipeline
# stages over data parallelism, DDP with experts over all ranks, HSDP (2 replicas x 2 shards, the
# all-gathers and reduce-scatters on the shard groups, the all-reduces on the replica groups).
LAYOUTS = {
    "fsdp_tp2_ep2": ["parallel.tp=2", "parallel.ep=2", "parallel.dp_mode=fsdp"],
    "pp2_dp2": ["parallel.pp=2", "parallel.dp_mode=fsdp"],
    "ddp_ep4": ["parallel.ep=4", "parallel.dp_mode=ddp"],
    "hsdp_r2": ["parallel.dp_replicate=2", "parallel.dp_mode=fsdp"],
}


def _layout_job(name: str, run_dir: str):
    return compose_job(
        COMMON
        + [
            f"train.run_dir={run_dir}",
            "parallel.world_size=4",
            "data.streams=4",
            "train.global_batch_size=8",
        ]
        + LAYOUTS[name]
    )


def _measure_layouts(rank: int, tmp: str) -> None:
    import json
    import os

    os.environ.update(WORLD_SIZE="4", RANK=str(rank), LOCAL_RANK=str(rank))
    for name in LAYOUTS:
        got = measure_trainer_step(_layout_job(name, f"{tmp}/{name}"))
        with open(f"{tmp}/{name}.{rank}.json", "w") as f:
            json.dump(got, f)


def _plan_layout(name: str, run_dir: str, rank: int):
    return dry_run(_layout_job(name, run_dir), rank=rank, bf16=False)


@pytest.mark.slow
def test_four_rank_layouts_bytes_and_collectives_equal_the_real_run(tmp_path):
    import json

    from gloo_ranks import run_forked, run_ranks

    run_ranks(_measure_layouts, 4, tmp_path, str(tmp_path), timeout_s=300)
    # the dry runs of every (layout, rank), in two forked workers
    calls = [(name, str(tmp_path / "plan"), rank) for name in LAYOUTS for rank in range(4)]
    plans = dict(zip(((c[0], c[2]) for c in calls), run_forked(_plan_layout, calls)))
    for name in LAYOUTS:
        for rank in range(4):
            real = json.loads((tmp_path / f"{name}.{rank}.json").read_text())
            plan = plans[name, rank]
            where = f"{name} rank {rank}"
            assert plan.params_bytes == real["params_bytes"], where
            assert plan.optimizer_bytes == real["optimizer_bytes"], where
            assert plan.comm_bytes == real["comm_bytes"], (
                where,
                plan.comm_bytes,
                real["comm_bytes"],
            )
            assert abs(plan.peak_bytes - real["peak_bytes"]) <= 0.15 * real["peak_bytes"], (
                where,
                plan.peak_bytes,
                real["peak_bytes"],
            )
    # HSDP: FSDP's gathers and reduce-scatters on the shard groups, the gradients' all-reduce on the
    # replica groups, nothing left on the whole dp x cp group (it serves only the step's scalars)
    comm = json.loads((tmp_path / "hsdp_r2.0.json").read_text())["comm_bytes"]
    shard = next(v for k, v in comm.items() if "dense_shard" in k.split("/"))
    replica = next(v for k, v in comm.items() if "dense_replicate" in k.split("/"))
    assert shard["all_gather"] > 0 and shard["reduce_scatter"] > 0 and "all_reduce" not in shard
    assert set(replica) == {"all_reduce"} and replica["all_reduce"] > 0
    # the all-reduce carries the reduce-scatter's output: 1/2 of its input (shard groups of 2)
    replicated = sum(
        v.get("all_reduce", 0)
        for k, v in comm.items()
        if any(role.endswith("_replicate") for role in k.split("/"))
    )
    assert replicated == pytest.approx(
        sum(v.get("reduce_scatter", 0) for v in comm.values()) / 2, rel=0.01
    ), comm


def _short_and_full(run_dir: str, layout: list[str], rank: int, every: bool):
    job = compose_job(
        COMMON
        + [f"train.run_dir={run_dir}", "parallel.world_size=2", "data.streams=2"]
        + ["train.global_batch_size=8", *layout]
    )
    return dry_run(job, rank=rank, bf16=False, every_micro_batch=every)


@pytest.mark.slow
def test_micro_batches_not_run_are_extrapolated_exactly(tmp_path):
    """A step's later micro-batches repeat: the dry run runs two (no pipeline) or two short schedules
    (pipeline) and extrapolates; running every micro-batch gives the same bytes and peak."""
    from gloo_ranks import run_forked

    layouts = (["parallel.ep=2"], ["parallel.pp=2"], ["parallel.pp=2", "parallel.dp_mode=ddp"])
    # every dry run, in two forked workers (the longer, every micro-batch, first)
    calls = [(str(tmp_path), x, r, e) for e in (True, False) for x in layouts for r in (0, 1)]
    runs = dict(zip(((str(c[1]), c[2], c[3]) for c in calls), run_forked(_short_and_full, calls)))
    for layout in layouts:
        for rank in (0, 1):
            short, full = runs[str(layout), rank, False], runs[str(layout), rank, True]
            assert short.comm_bytes == full.comm_bytes and short.comm_bytes, (layout, rank)
            # the peak to within bytes (scalars kept per micro-batch round differently)
            assert abs(short.peak_bytes - full.peak_bytes) <= 1e-4 * full.peak_bytes, (layout, rank)
            assert (short.params_bytes, short.optimizer_bytes) == (
                full.params_bytes,
                full.optimizer_bytes,
            )
