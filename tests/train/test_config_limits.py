"""Silent wrong values refused before anything is allocated: NaN, infinite and out-of-range numbers
in the job config, and a model whose weights, gradients and AdamW state cannot fit the device
(estimated from the config and the layout; the model is not even built on meta)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moevlm.config import check_memory, compose_job, estimate_memory, memory_limit, validate
from moevlm.config.memory import BYTES_FROZEN, BYTES_TRAINED
from moevlm.errors import ConfigError
from moevlm.model import Qwen3VLMoe
from moevlm.model.params import layer_parameters, num_parameters, parameter_counts
from moevlm.parallel.pipeline import prune_to_stages

REPO = Path(__file__).resolve().parents[2]
HUGE = "model.num_layers=1000000"  # 86.7B tiny parameters, 1.3 TB of model state: more than any test machine


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optim.grad_clip=nan",
            "optim.grad_clip=nan must be a finite number (the max gradient norm; 0 or less disables",
        ),
        ("optim.grad_clip=inf", "optim.grad_clip=inf must be a finite number"),
        ("optim.eps=-1e-8", "optim.eps=-1e-08 must be a finite number > 0"),
        ("optim.eps=nan", "optim.eps=nan must be a finite number > 0"),
        ("optim.eps=0", "optim.eps=0.0 must be a finite number > 0"),
        ("optim.weight_decay=nan", "optim.weight_decay=nan must be a finite number >= 0"),
        ("optim.weight_decay=inf", "optim.weight_decay=inf must be a finite number >= 0"),
        ("optim.betas=[nan,0.95]", "optim.betas=[nan, 0.95] must be two numbers in [0, 1)"),
        ("optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0] must be two numbers"),
        ("optim.min_lr_ratio=nan", "optim.min_lr_ratio=nan must be a number in [0, 1]"),
        ("optim.decay_fraction=nan", "optim.decay_fraction=nan must be a number in (0, 1]"),
        ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
        ("optim.lr=nan", "optim.lr=nan must be a finite number > 0"),
        ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be >= 0"),
        ("model.aux_loss_coef=nan", "model.aux_loss_coef=nan must be a finite number >= 0"),
        ("model.aux_loss_coef=-0.01", "model.aux_loss_coef=-0.01 must be a finite number >= 0"),
        ("model.num_layers=0", "model.num_layers=0 must be an integer >= 1"),
        (
            "model.num_experts=-1",
            "model.num_experts=-1 must be an integer >= 0 (0: a dense MLP in every layer)",
        ),
        ("model.vision_depth=0", "model.vision_depth=0 must be an integer >= 1"),
        ("train.peak_tflops=0", "train.peak_tflops=0.0 must be a finite number > 0"),
        ("train.peak_tflops=nan", "train.peak_tflops=nan must be a finite number > 0"),
        ("train.log_every=0", "train.log_every=0 must be >= 1"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps=0 must be >= 1"),
    ],
)
def test_nan_infinite_and_out_of_range_numbers_are_named(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_job([override]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_documented_edge_values_stay_allowed():
    """grad_clip <= 0 disables clipping; aux_loss_coef=0 turns the aux loss off; keep_checkpoints <= 0
    keeps all; warmup past the end is allowed but noted for the log."""
    plan = validate(
        compose_job(
            [
                "optim.grad_clip=0",
                "model.aux_loss_coef=0",
                "train.keep_checkpoints=-1",
                "optim.grad_clip=-1",
                "optim.weight_decay=0",
            ]
        )
    )
    assert plan.notes == []
    # the last step is at lr
    assert validate(compose_job(["optim.warmup_steps=20", "train.steps=20"])).notes == []
    plan = validate(compose_job(["optim.warmup_steps=21", "train.steps=20"]))
    assert plan.notes == [
        "note: optim.warmup_steps=21 > train.steps=20: the learning rate never reaches "
        "optim.lr=0.002 in this run"
    ]


# ------------------------------------------------------------------ memory estimate
def test_single_rank_estimate_is_the_exact_count_at_16_bytes():
    job = compose_job([])
    est = estimate_memory(validate(job))
    assert est.params == est.total_params == num_parameters(validate(job).model)
    assert est.bytes == BYTES_TRAINED * est.params
    # a frozen tower has no gradient, no AdamW state
    job = compose_job(["model.freeze_vision=true"])
    vision = parameter_counts(validate(job).model)["vision"]
    assert (
        estimate_memory(validate(job)).bytes
        == BYTES_TRAINED * (est.params - vision) + BYTES_FROZEN * vision
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.pp=2", "train.global_batch_size=2"],
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "model.num_layers=6",
            "train.global_batch_size=4",
        ],
    ],
)
def test_pipeline_estimate_is_the_fullest_pp_ranks_pruned_model(overrides):
    job = compose_job(overrides)
    plan = validate(job, 2)
    held = []
    for r in range(plan.pipeline.pp):
        with torch.device("meta"):
            model = Qwen3VLMoe(plan.model)
        prune_to_stages(model, plan.pipeline, r)
        held.append(sum(p.numel() for p in model.parameters()))
    assert estimate_memory(plan).params == max(held) < num_parameters(plan.model)


def test_sharded_estimates_divide_each_part_by_its_sharding():
    cfg = validate(compose_job([])).model
    total = num_parameters(cfg)
    layers = [layer_parameters(cfg, i) for i in range(cfg.text.num_layers)]
    experts = sum(p["experts"] for p in layers)
    # + the final norm
    whole_per_tp = sum(p["norms"] + p["router"] for p in layers) + cfg.text.hidden_size
    vision = parameter_counts(cfg)["vision"]

    def est(overrides, world):
        job = compose_job(overrides)
        return estimate_memory(validate(job, world)).params

    # FSDP, tp=1: every weight sharded over the 8 ranks (experts by ep=8)
    assert (
        est(["parallel.ep=8", "model.dispatcher=alltoall", "train.global_batch_size=8"], 8)
        == total / 8
    )
    # DDP: whole weights per rank, except the experts split by ep=2
    assert (
        est(
            [
                "parallel.ep=2",
                "parallel.dp_mode=ddp",
                "model.dispatcher=alltoall",
                "train.global_batch_size=4",
            ],
            4,
        )
        == total - experts / 2
    )
    # tp=2 (dp=1): TP halves attention, embedding and head; norms and router stay whole; FSDP shards the
    # vision tower and (edp=2) the experts over both ranks
    assert est(["parallel.tp=2"], 2) == (total - whole_per_tp) / 2 + whole_per_tp
    # HSDP, 2 replicas of 4 (experts edp 8 = 2 x 4): everything sharded over 4 ranks, not 8
    assert est(["parallel.dp_replicate=2", "train.global_batch_size=8"], 8) == total / 4
    # tp 2 x dp 4 as 2 replicas x 2: TP-split weights over tp 2 x shard 2, the tp-whole norms and
    # router over the shard 2 only (FSDP: 8 and 4), the experts over edp 8 / 2 replicas
    assert est(
        ["parallel.tp=2", "parallel.dp_replicate=2", "train.global_batch_size=8"], 8
    ) == pytest.approx((total - whole_per_tp) / 4 + whole_per_tp / 2)
    assert vision > 0 and experts > 0


def test_huge_model_refused_from_the_config_with_the_estimate():
    job = compose_job(["model.num_layers=100000"])
    plan = validate(job)
    with pytest.raises(ConfigError) as err:
        check_memory(plan, 16 * 2**30, "a 16 GiB device")
    assert str(err.value).startswith(
        "the model needs about 129.2 GiB per rank for weights, gradients and AdamW state (8.67B of the model's "
        "8.67B parameters; world 1 = pp 1 x dp 1 x cp 1 x tp 1 = pp 1 x edp 1 x ep 1 x etp 1) but a 16 GiB "
        "device has 16.0 GiB; use fewer layers or experts (model.num_layers, model.num_experts) or shard more"
    )
    est = check_memory(plan, 150 * 2**30)  # fits, but above 80%: a note for the log
    assert est.bytes < 150 * 2**30 and plan.notes[-1].startswith(
        "note: the model needs about 129.2 GiB"
    )
    job = compose_job([])
    plan = validate(job)
    # the embedded default fits this machine, without a note
    check_memory(plan, *memory_limit("cpu"))
    assert plan.notes == []


def test_cpu_limit_is_available_memory_shared_by_the_local_ranks(monkeypatch):
    one = memory_limit("cpu")[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four, where = memory_limit("cpu")
    assert 0 < four < one / 3 and "shared by 4 ranks" in where


def test_trainer_refuses_before_building_anything(tmp_path, monkeypatch):
    from moevlm.train.trainer import Trainer

    monkeypatch.setattr(Qwen3VLMoe, "__init__", lambda *a, **k: pytest.fail("the model was built"))
    start = time.perf_counter()
    with pytest.raises(
        ConfigError, match=r"the model needs about [0-9.]+ GiB per rank .* but this machine"
    ):
        Trainer(compose_job([HUGE, f"train.run_dir={tmp_path / 'run'}"]))
    # building a million layers on meta takes minutes; the refusal a few seconds, under load too
    assert time.perf_counter() - start < 60
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_py_prints_one_config_error_line_and_exits_2(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), HUGE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out
    assert len(out.splitlines()) == 1 and out.startswith("config error: the model needs about "), (
        out
    )
    assert "86.7B of the model's 86.7B parameters" in out
    assert not list(tmp_path.iterdir())
    assert time.perf_counter() - start < 60
