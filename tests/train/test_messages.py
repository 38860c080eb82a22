"""Mistakes a user brings from elsewhere, each refused in one `config error:` line that names the fix:
option names of other trainers (HF Trainer, torchtitan, Megatron) under any section or none, a recipe or
group choice that conf/ lacks (the nearest and the whole list), and a GPU recipe launched on a machine
without CUDA (the `+scale=cpu` way to run its shape there, after the refusal's own lines)."""

from __future__ import annotations

import pytest
import torch

from moevlm.config import check_overrides, compose_job, validate
from moevlm.config.validation import CPU_TRY
from moevlm.errors import ConfigError


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        check_overrides(overrides)
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "given, fix",
    [
        ("optim.learning_rate=1e-3", "did you mean optim.lr?"),
        ("learning_rate=1e-3", "did you mean optim.lr?"),
        ("lr=1e-3", "did you mean optim.lr?"),
        ("train.max_steps=5", "did you mean train.steps?"),
        ("train.batch_size=8", "did you mean train.global_batch_size or train.micro_batch_size?"),
        ("seq_length=4096", "did you mean data.pack.seq_len?"),
        ("data.max_seq_len=4096", "did you mean data.pack.seq_len?"),
        ("train.output_dir=runs/a", "did you mean train.run_dir?"),
    ],
)
def test_names_from_other_trainers_point_at_ours(given, fix):
    line = _refusal([given])
    assert line.startswith(f"{given.split('=')[0]} is not an option; {fix}"), line


def test_a_group_choice_conf_lacks_names_the_nearest_and_lists_them():
    line = _refusal(["+experiment=gb200-3d"])
    assert line.startswith(
        "+experiment=gb200-3d is not a recipe of conf/experiment/; did you mean +experiment=gb200_3d?"
    )
    assert "h100_fsdp" in line and "sweep_tuning" in line  # the whole list
    assert "did you mean model=tiny?" in _refusal(["model=tiny2"])
    # what exists passes, and plain options are not group choices
    check_overrides(["+experiment=h100_fsdp", "+scale=cpu", "model=tiny", "train.steps=3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line is for a machine without CUDA")
def test_a_gpu_recipe_on_a_cpu_machine_ends_with_the_scale_line():
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["+experiment=gb200_3d", "data.shards=sample"]), 1)
    lines = str(err.value).splitlines()
    assert len(lines) > 1 and lines[-1] == CPU_TRY
    assert "+scale=cpu" in CPU_TRY
    # a job that is wrong for another reason gets no such line
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["data.shards=sample", "model.attn_backend=nope"]), 1)
    assert CPU_TRY not in str(err.value)
