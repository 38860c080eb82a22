"""`+scale=cpu`: every recipe scaled down to at most 8 CPU processes with one override, its parallel
shape kept (moevlm.config.scale).

Every experiment is composed with the scale and validated for the world size it asks for (no
processes): tp, cp, pp, etp, the schedule, dp_mode and the dispatcher are the recipe's, ep is the
recipe's wherever it fits, the batch and streams are legal.  Then the scaled recipes run 2 steps:
h200_1gpu in this process, h100_fsdp on 8 gloo ranks as train.py runs it (gb200_fsdp scales to the same job, asserted
here, so that launch covers it; gb200_3d's launch is tests/parallel/test_pipeline.py's, compared
there to one process), and h100_deepep is refused in one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from gloo_ranks import run_ranks
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
SHAPE = ("tp", "cp", "pp", "etp", "pp_schedule", "vpp", "dp_mode")


def scaled(name: str, extra: tuple[str, ...] = ()):
    """(the recipe, the scaled job, its plan) validated for the world size the scale asks for."""
    recipe = compose_job([f"+experiment={name}", *extra])
    job = compose_job([f"+experiment={name}", "+scale=cpu", *extra])
    if job.model.dispatcher in ("deepep", "hybridep"):
        return recipe, job, None
    with pytest.raises(
        ConfigError, match=r"launch torchrun --standalone --nproc-per-node (\d+) "
    ) as err:
        validate(compose_job([f"+experiment={name}", "+scale=cpu", *extra]), 1000)  # the launch
    world = int(re.search(r"--nproc-per-node (\d+) ", str(err.value)).group(1))
    return recipe, job, validate(job, world)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_recipe_scales_down_keeping_its_shape(name):
    recipe, job, plan = scaled(name)
    assert (
        all(job.parallel[k] == recipe.parallel[k] for k in SHAPE)
        and job.model.dispatcher == recipe.model.dispatcher
    )
    # deepep, hybridep without their package (CPU machines): refused first, whatever the launch
    if plan is None:
        with pytest.raises(
            ConfigError,
            match=rf"^model.dispatcher='{job.model.dispatcher}' cannot run: the deep_ep "
            r"package is not installed",
        ):
            validate(job, 8)
        return
    d, m = plan.dims, plan.model
    assert job.model.preset == "tiny" and job.data.shards == "sample" and job.train.device == "cpu"
    assert job.train.precision == "fp32" and job.data.pack.seq_len == 1024 and job.optim.lr == 2e-3
    assert d.world == job.parallel.world_size <= 8 and (d.tp, d.cp, d.pp, d.etp) == (
        recipe.parallel.tp,
        recipe.parallel.cp,
        recipe.parallel.pp,
        recipe.parallel.etp,
    )
    recipe_stage = (recipe.parallel.world_size or 1) // (d.tp * d.cp * d.pp)
    assert d.dp == min(recipe_stage, 8 // (d.tp * d.cp * d.pp))  # dp shrinks first
    assert m.moe.num_experts % d.ep == 0 and (
        d.ep == recipe.parallel.ep or d.ep * d.etp * 2 > d.world // d.pp
    )
    assert job.train.global_batch_size == job.train.micro_batch_size * plan.grad_accum * d.dp
    assert plan.pipeline is None or plan.grad_accum == 2 * plan.pipeline.num_stages
    assert plan.notes[0].startswith(f"scale (parallel.scale_to=8): tiny model on {d.world} process")
    assert validate(job, d.world).dims == d  # validated again: the scaled job scales to itself


def test_gb200_3d_and_gb200_fsdp_scaled():
    """The README's gb200_3d numbers (ep 8 -> 4 so that ep divides a stage's 4 ranks), and gb200_fsdp
    scaling to exactly h100_fsdp's job but for the three settings h100_fsdp takes to fit an H100
    (full recompute, cp 2, bf16 moments; the launch below runs h100_fsdp's)."""
    _, job, plan = scaled("gb200_3d")
    assert (
        plan.dims.describe() == "world 8 = pp 2 x dp 2 x cp 1 x tp 2 = pp 2 x edp 1 x ep 4 x etp 1"
    )
    assert (job.train.global_batch_size, job.data.streams, plan.grad_accum) == (8, 0, 4)
    assert "world_size 32->8, dp 8->2, ep 8->4" in plan.notes[0]
    fit = ("model.recompute=none", "parallel.cp=1", "optim.state_dtype=float32")
    jobs = [OmegaConf.to_container(scaled(*n)[1]) for n in (("gb200_fsdp",), ("h100_fsdp", fit))]
    assert jobs[0] == jobs[1]


def test_hsdp_replicas_shrink_to_what_the_scaled_layout_divides():
    """A recipe with HSDP replicas keeps them where the scaled dp and edp allow, else fewer."""
    base = ["+experiment=h100_fsdp", "parallel.world_size=64", "+scale=cpu", "parallel.cp=1"]
    # ep 4 -> edp 2 at 8 ranks: 8 replicas become 2
    job = compose_job([*base, "parallel.dp_replicate=8", "parallel.ep=4"])
    plan = validate(job, 8)
    assert (plan.dims.dp, plan.dims.edp, plan.dims.dp_replicate) == (8, 2, 2)
    assert "dp_replicate 8->2" in plan.notes[0]
    # ep 8 leaves edp 1: no replica fits, plain FSDP
    plan = validate(compose_job([*base, "parallel.dp_replicate=8"]), 8)
    assert plan.dims.dp_replicate == 1 and "dp_replicate 8->1" in plan.notes[0]


def test_scale_before_the_experiment_and_a_shape_too_big_are_refused():
    with pytest.raises(ConfigError, match=r"put \+scale=cpu after \+experiment=NAME"):
        validate(compose_job(["+scale=cpu", "+experiment=h100_fsdp"]), 8)
    with pytest.raises(
        ConfigError,
        match="tp x cp x pp = 2 x 1 x 2 = 4 processes do not fit in parallel.scale_to=2",
    ):
        validate(compose_job(["+experiment=gb200_3d", "+scale=cpu", "parallel.scale_to=2"]), 4)
    job = compose_job(
        ["+experiment=gb200_3d", "+scale=cpu", "parallel.pp_schedule=interleaved_1f1b"]
    )
    plan = validate(job, 8)  # 4 stages > the tiny model's 3 layers: one layer per stage
    assert job.model.num_layers == 4 and plan.pipeline.num_stages == 4 and plan.grad_accum == 8


def _run_on_ranks(rank: int, world: int, overrides: list[str]) -> None:
    """The job of `overrides` run on every rank as train.py runs it (`Trainer(job).run()`): exit 0."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    assert Trainer(compose_job(overrides)).run() == 0


@pytest.mark.slow
def test_scaled_recipes_run_two_steps(tmp_path, capfd, monkeypatch):
    """h200_1gpu (1 process, here) and h100_fsdp (8 gloo ranks: FSDP2, EP8 all-to-all, CP2,
    full recompute, bf16 moments) run 2 steps
    scaled down; h100_deepep is refused in one line naming the fallback (no deep_ep package on a CPU
    machine; train.py prints a config error's lines and exits 2: tests/train/test_trainer.py)."""
    common = [
        "+scale=cpu",
        "train.steps=2",
        "train.tensorboard=false",
        "train.checkpoint_at_end=false",
        "data.num_workers=0",
    ]  # no loader workers: 8 ranks x 2 workers would crowd a 2-core machine
    with pytest.raises(ConfigError) as deep:
        Trainer(compose_job(["+experiment=h100_deepep", *common]))
    assert str(deep.value).count("\n") == 0, str(deep.value)
    assert str(deep.value).startswith("model.dispatcher='deepep' cannot run: ")
    assert "model.dispatcher_fallback=alltoall" in str(deep.value)
    run_dir = tmp_path / "h200_1gpu"
    capfd.readouterr()
    assert (
        Trainer(compose_job(["+experiment=h200_1gpu", *common, f"train.run_dir={run_dir}"])).run()
        == 0
    )
    assert "scale (parallel.scale_to=8): tiny model on 1 process" in capfd.readouterr().out
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    # 8 gloo ranks forked from the test session's launchers (tests/gloo_ranks.py), each running the job as
    # train.py runs it (`Trainer(job).run()`, exit 0): 8 interpreters starting and importing torch cost
    # ~40 CPU-s on 2 cores.  train.py itself under torchrun on 8 processes: test_pipeline.py's gb200_3d
    run_dir = tmp_path / "h100_fsdp"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "launch").mkdir()
    capfd.readouterr()
    job = ["+experiment=h100_fsdp", *common, f"train.run_dir={run_dir}"]
    run_ranks(_run_on_ranks, 8, tmp_path / "launch", 8, job, timeout_s=300)
    out = "".join(capfd.readouterr())  # the ranks' stdout and stderr
    assert "scale (parallel.scale_to=8): tiny model on 8 process" in out, out[-4000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
